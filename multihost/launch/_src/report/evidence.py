"""Pure: what a controller's output says: when it first raised (a Python traceback), what it was doing at a given moment, which peers it named as failed, whether JAX aborted it for a lost service.

The launcher notes when it read each line (`Output`), so the first error of
a run is the first traceback it read, not the first exit: a process that
raised may linger (an exit handshake, a peer it waits for) and exit after
the others.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import re
import signal

TRACEBACK = 'Traceback (most recent call last):'
# The lines between the tracebacks of a chain of exceptions.
CHAINED = ('During handling of the above exception, another exception '
            'occurred:',
            'The above exception was the direct cause of the following '
            'exception:')
_MAX_TEXT = 160
# How long after a traceback's first line the rest of its chain may be read.
_BURST_S = 2.0


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
  """The first Python traceback in `lines` (read at `times`), or None (also when no times are known).

  Of a chain of exceptions ("The above exception was the direct cause ...")
  it takes the last one's line, the exception that was raised out. The
  chain's tracebacks are printed at once, so only those read within 2 s of
  its first line count (a message may span lines and blank lines).
  """
  if len(times) != len(lines):
    return None
  start = next((k for k, line in enumerate(lines) if TRACEBACK in line), None)
  if start is None:
    return None
  last = start  # The header of the chain's last traceback.
  previous = ''  # The last non-blank line before the current one.
  for k in range(start + 1, len(lines)):
    if times[k] > times[start] + _BURST_S:
      break
    if TRACEBACK in lines[k]:
      if previous.strip() not in CHAINED:
        break  # Another exception, not this one's chain.
      last = k
    if lines[k].strip():
      previous = lines[k]
  error = next(
      (text for text in lines[last + 1:]
       if text.strip() and text[0] not in ' \t' and TRACEBACK not in text and
       text.strip() not in CHAINED), '')
  return Raised(time=times[start], error=_short(error) or '(no message)')


# absl's / glog's line header: level, date, time, thread, file:line.
_LOG_HEADER = re.compile(r'^[IWEF]\d{4} [\d:.]+ +\d+ [^ \]]+:\d+\] ')


def last_line_before(lines: collections.abc.Sequence[str],
                     times: collections.abc.Sequence[float],
                     when: float) -> tuple[float, str] | None:
  """The last non-blank line read at or before `when`, with its time, without a log line's header (level, date, thread, file); None if none (or no times)."""
  if len(times) != len(lines):
    return None
  for text, t in zip(reversed(lines), reversed(times), strict=True):
    if t <= when and text.strip():
      return t, _short(_LOG_HEADER.sub('', text))
  return None


def named_as_failed(output: str) -> set[int]:
  """The processes a process's output names as failed ("process(es) [1, 2] failed")."""
  return {int(i) for found in _NAMED_FAILED.findall(output)
          for i in found.split(',') if i.strip()}


_NAMED_FAILED = re.compile(r'process\(es\) \[([0-9, ]*)\] failed')


# What JAX's client prints before it aborts a process (SIGABRT) that lost
# the coordination service: a missed heartbeat (partition) or a service gone.
LOST_SERVICE_MARKER = ('Terminating process because the JAX distributed '
                       'service detected fatal errors')


def lost_coordinator(returncodes: tuple[int | None, ...],
                     outputs: tuple[str, ...]) -> list[int]:
  """The processes JAX aborted because they lost the coordination service (SIGABRT + its log line)."""
  return [i for i, rc in enumerate(returncodes)
          if rc == -signal.SIGABRT and i < len(outputs)
          and LOST_SERVICE_MARKER in outputs[i]]
