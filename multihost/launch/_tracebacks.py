"""Pure: what a controller's timed output lines say: when it first raised (a Python traceback) and what it was doing at a given moment.

The launcher notes when it read each line (`Output`), so the first error of
a run is the first traceback it read, not the first exit: a process that
raised may linger (an exit handshake, a peer it waits for) and exit after
the others.
"""

from __future__ import annotations

import collections.abc
import dataclasses

TRACEBACK = 'Traceback (most recent call last):'
# The lines between the tracebacks of a chain of exceptions.
_CHAINED = ('During handling of the above exception, another exception '
            'occurred:',
            'The above exception was the direct cause of the following '
            'exception:')
_MAX_TEXT = 160


@dataclasses.dataclass(frozen=True)
class Raised:
  """A process's first traceback: when the launcher read its first line, and the exception it ended with.

  Attributes:
    time: seconds from the attempt's start.
    error: the exception line ('ValueError: boom'); of a chain of
      exceptions, the last (the one that was raised out).
  """
  time: float
  error: str


def _short(text: str) -> str:
  text = text.strip()
  return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT - 3] + '...'


def first_raised(lines: collections.abc.Sequence[str],
                 times: collections.abc.Sequence[float]) -> Raised | None:
  """The first Python traceback in `lines` (read at `times`), or None (also when no times are known)."""
  if len(times) != len(lines):
    return None
  start = next((k for k, line in enumerate(lines) if TRACEBACK in line), None)
  if start is None:
    return None
  error = ''
  i = start + 1
  while i < len(lines):
    text = lines[i]
    if (not text.strip() or text[0] in ' \t' or TRACEBACK in text or
        text.strip() in _CHAINED):
      i += 1  # A frame, a caret line, a blank, or the next traceback.
      continue
    error = text
    # The message may go on for lines; a chained exception follows a blank.
    j = i + 1
    while j < len(lines) and lines[j].strip() and TRACEBACK not in lines[j]:
      j += 1
    while j < len(lines) and not lines[j].strip():
      j += 1
    if j < len(lines) and lines[j].strip() in _CHAINED:
      i = j
      continue
    break
  return Raised(time=times[start], error=_short(error) or '(no message)')


def last_line_before(lines: collections.abc.Sequence[str],
                     times: collections.abc.Sequence[float],
                     when: float) -> tuple[float, str] | None:
  """The last non-blank line read at or before `when`, with its time; None if none (or no times)."""
  if len(times) != len(lines):
    return None
  for text, t in zip(reversed(lines), reversed(times), strict=True):
    if t <= when and text.strip():
      return t, _short(text)
  return None
