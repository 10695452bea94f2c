"""Controllers' output: captures each process's lines, and when each was read, and streams them live with a `[pN] ` prefix, holding back what a healed failure would flood the screen with.

(cf. torchrun's `multiprocessing/tail_log.py`.) While a restart would follow
a failure (`hold_tracebacks`), the lines of a Python traceback are held
instead of streamed, and once the attempt fails (`hold_all`) so is every
line; the owner then either drops them (the failure heals: the attempt's
output goes to a file instead, see `Controllers`) or streams them late
(`release`: no restart follows, so the traceback is shown once).
"""

from __future__ import annotations

import re
import threading
import time
from typing import BinaryIO
from typing import TextIO

from multihost._src.diagnostics import gloo_lines as _gloo_lines
from multihost.launch._src.report import evidence as _evidence

# A held traceback is streamed after all when no process failed this long
# after its last line (a program that logged an exception and went on).
HELD_TRACEBACK_S = 60.0
# After a traceback's exception line, more lines read within this many
# seconds that are not log lines belong to its message (or chain).
_MESSAGE_S = 0.5
# absl's / glog's line header ('E1203 05:17:33.225821 ...').
_LOG_LINE = re.compile(r'^[IWEF]\d{4} \d\d:\d\d:\d\d')
# Per process, where its output is in a traceback.
_OUT, _FRAMES, _MESSAGE = 'out', 'frames', 'message'


def _in_traceback(state: str, line: str, *, since_held: float) -> str:
  """The traceback state after `line` (`_OUT`: not part of one), from the state before it.

  A traceback is its header, indented frame lines and blank lines up to its
  exception line (`_FRAMES`), then its message: lines read within 0.5 s
  that are not log lines, a chained exception's marker and traceback
  (`_MESSAGE`).
  """
  text = line.rstrip('\n')
  if _evidence.TRACEBACK in text:
    return _FRAMES
  if state == _FRAMES:
    if (not text.strip() or text[0] in ' \t' or
        text.strip() in _evidence.CHAINED):
      return _FRAMES
    return _MESSAGE  # The exception line.
  if state == _MESSAGE:
    if text.strip() in _evidence.CHAINED:
      return _FRAMES
    if since_held <= _MESSAGE_S and not _LOG_LINE.match(text):
      return _MESSAGE
  return _OUT


class Output:
  """The merged stdout/stderr lines of N processes, captured and optionally streamed.

  Lines are appended by one `pump()` thread per process; readers wait on
  `changed`, a condition the owner shares (it is notified on every line).

  Args:
    num_processes: number of processes.
    changed: the condition to notify when a line arrives (its lock guards
      the captured lines).
    stream: where to write the `[pN] `-prefixed lines live (None: only
      capture them).
    quiet_gloo: drop gloo's connection lines (`[Gloo] Rank N is connected
      to M peer ranks. ...`, see `multihost._src.diagnostics.gloo_lines`),
      neither captured nor streamed; every other line is kept, in order.
  """

  def __init__(self, num_processes: int, *, changed: threading.Condition,
               stream: TextIO | None = None, quiet_gloo: bool = True):
    self._lines: list[list[str]] = [[] for _ in range(num_processes)]
    # Per line, time.monotonic() when it was read (the first error of a run
    # is the first traceback read, see `_evidence`).
    self._times: list[list[float]] = [[] for _ in range(num_processes)]
    self._changed = changed
    self._stream = stream
    self._write_lock = threading.Lock()
    # Holding (see the module's docstring): guarded by `_write_lock`.
    self._hold_tracebacks = False
    self._hold_all = False
    self._state = [_OUT] * num_processes
    self._last_held = [0.0] * num_processes  # Last traceback line's time.
    self._held: list[tuple[int, str, float]] = []  # (process, line, time)
    self._gloo = ([_gloo_lines.LineFilter() for _ in range(num_processes)]
                  if quiet_gloo else None)

  def hold_tracebacks(self) -> None:
    """From now on, hold the lines of Python tracebacks instead of streaming them (a restart would follow a failure)."""
    with self._write_lock:
      self._hold_tracebacks = True

  def hold_all(self) -> None:
    """From now on, hold every line (the attempt failed and is being stopped for a restart)."""
    with self._write_lock:
      self._hold_all = True

  def held(self) -> int:
    """How many lines are held now."""
    with self._write_lock:
      return len(self._held)

  def drop_held(self) -> int:
    """Forgets the held lines (captured all the same) and holds nothing more; returns how many there were."""
    with self._write_lock:
      n = len(self._held)
      self._held.clear()
      self._hold_tracebacks = self._hold_all = False
      return n

  def release(self, *, older_than: float | None = None) -> None:
    """Streams the held lines, in the order they were read, and holds nothing more.

    With `older_than` (seconds), only when the newest held line was read
    longer ago than that (a traceback no failure followed), and holding
    goes on.
    """
    with self._write_lock:
      if not self._held:
        if older_than is None:
          self._hold_tracebacks = self._hold_all = False
        return
      if (older_than is not None and
          time.monotonic() - self._held[-1][2] <= older_than):
        return
      for index, line, _ in self._held:
        self._write_locked(index, line)
      self._held.clear()
      if older_than is None:
        self._hold_tracebacks = self._hold_all = False

  def _write_locked(self, index: int, line: str) -> None:
    """Streams one line with its prefix (caller holds `_write_lock`)."""
    if self._stream is None:
      return
    try:
      self._stream.write(f'[p{index}] {line}')
      self._stream.flush()
    except (OSError, ValueError):  # Closed stream: keep capturing.
      pass

  def text(self, index: int) -> str:
    """Process `index`'s output so far, without prefixes (caller holds no lock)."""
    with self._changed:
      return ''.join(self._lines[index])

  def text_locked(self, index: int) -> str:
    """As `text`, for a caller that holds `changed` already."""
    return ''.join(self._lines[index])

  def times_locked(self, index: int) -> list[float]:
    """Per line of `text_locked(index)`, the time.monotonic() it was read at (caller holds `changed`)."""
    return list(self._times[index])

  def pump(self, index: int, pipe: BinaryIO) -> None:
    """Reads `pipe` to its end, line by line (runs in its own thread); closes it.

    The process's stdout and stderr are this one pipe, so its lines come in
    the order it wrote them; a line is taken whole (to its newline, or the
    pipe's end).
    """
    for raw in iter(pipe.readline, b''):
      if self._gloo is not None:
        raw = self._gloo[index].line(raw, last=not raw.endswith(b'\n'))
        if not raw:
          continue
      line = raw.decode('utf-8', errors='replace')
      if not line.endswith('\n'):
        line += '\n'
      now = time.monotonic()
      with self._changed:
        self._lines[index].append(line)
        self._times[index].append(now)
        self._changed.notify_all()
      with self._write_lock:
        self._state[index] = _in_traceback(
            self._state[index], line, since_held=now - self._last_held[index])
        if self._state[index] != _OUT:
          self._last_held[index] = now
        if self._hold_all or (self._hold_tracebacks and
                              self._state[index] != _OUT):
          self._held.append((index, line, now))
        else:
          self._write_locked(index, line)
    pipe.close()
    with self._changed:
      self._changed.notify_all()
