"""Controllers' output: captures each process's lines, and when each was read, and streams them live with a `[pN] ` prefix.

(cf. torchrun's `multiprocessing/tail_log.py`.)
"""

from __future__ import annotations

import threading
import time
from typing import BinaryIO
from typing import TextIO


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
  """

  def __init__(self, num_processes: int, *, changed: threading.Condition,
               stream: TextIO | None = None):
    self._lines: list[list[str]] = [[] for _ in range(num_processes)]
    # Per line, time.monotonic() when it was read (the first error of a run
    # is the first traceback read, see `_evidence`).
    self._times: list[list[float]] = [[] for _ in range(num_processes)]
    self._changed = changed
    self._stream = stream
    self._write_lock = threading.Lock()

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
    """Reads `pipe` to its end, line by line (runs in its own thread); closes it."""
    for raw in iter(pipe.readline, b''):
      line = raw.decode('utf-8', errors='replace')
      if not line.endswith('\n'):
        line += '\n'
      with self._changed:
        self._lines[index].append(line)
        self._times[index].append(time.monotonic())
        self._changed.notify_all()
      if self._stream is not None:
        with self._write_lock:
          try:
            self._stream.write(f'[p{index}] {line}')
            self._stream.flush()
          except (OSError, ValueError):  # Closed stream: keep capturing.
            pass
    pipe.close()
    with self._changed:
      self._changed.notify_all()
