"""Control plane: the flight recorder, each process's ring of its last collective calls and how long each waited.

Every rendezvous (see `_control_rendezvous`) appends one `Record` when it
starts and stamps its `end` when every process has met, or its `error` when
the call raised here (a timeout, a failed peer): either way the call is over
for this process, and `in_progress` no longer names it. That costs two clock
reads and one small object per call; nothing here blocks or talks to another
process. `_where` reads the ring to say what a process last did;
`straggler_report()` compares the waits across processes: everyone leaves a
meeting at about the same moment, so the process that waited least came
last, and the largest wait minus the smallest is by how much.
"""

from __future__ import annotations

import collections
import time

# Calls kept per process.
RING = 64


class Record:
  """One collective call: op, barrier name, call number, start and end (time.monotonic()).

  `error` is the name of the exception the call raised here, `failed_at`
  when, and `missing` the processes a timeout waited for in vain (then `end`
  stays None: the processes did not all meet).
  """

  __slots__ = ('op', 'name', 'call', 'start', 'end', 'error', 'failed_at',
               'missing')

  def __init__(self, op: str, name: str, call: int, start: float):
    self.op = op
    self.name = name
    self.call = call
    self.start = start
    self.end: float | None = None
    self.error: str | None = None
    self.failed_at: float | None = None
    self.missing: tuple[int, ...] = ()  # Of a timeout: who did not come.

  def label(self) -> str:
    """'sync_global_devices('step 3') (call 12)', or 'process_allgather (call 13)'."""
    name = f'({self.name!r})' if self.name else ''
    return f'{self.op}{name} (call {self.call})'


class Recorder:
  """One process's ring of its last RING calls (see the module docstring)."""

  __slots__ = ('_ring',)

  def __init__(self):
    self._ring: collections.deque[Record] = collections.deque(maxlen=RING)

  def begin(self, op: str, call: int, start: float, name: str = '') -> Record:
    """Records the start of call `call` of collective `op` (at `start`)."""
    record = Record(op, name, call, start)
    self._ring.append(record)
    return record

  @staticmethod
  def end(record: Record) -> None:
    """Records that every process met in `record`'s call."""
    record.end = time.monotonic()

  @staticmethod
  def fail(record: Record, error: BaseException) -> None:
    """Records that `record`'s call raised `error` here (it is over for this process)."""
    if record.end is None and record.error is None:
      record.error = type(error).__name__
      record.failed_at = time.monotonic()
      record.missing = tuple(getattr(error, 'missing', None) or ())

  def records(self) -> list[Record]:
    """The last RING calls, oldest first (a copy)."""
    return list(self._ring)

  def last_completed(self) -> Record | None:
    """The most recent call that completed, or None."""
    for record in reversed(self._ring):
      if record.end is not None:
        return record
    return None

  def in_progress(self) -> Record | None:
    """The call this process is waiting in (the newest, if it has neither completed nor raised)."""
    ring = self._ring
    if ring and ring[-1].end is None and ring[-1].error is None:
      return ring[-1]
    return None

  def last_failed(self) -> Record | None:
    """The newest call, if it raised here (a timeout, a failed peer); else None.

    A call that completed after it means the processes are in step again.
    """
    ring = self._ring
    if ring and ring[-1].error is not None:
      return ring[-1]
    return None

  def waits(self) -> dict[int, float]:
    """Call number -> seconds this process waited in it, for the completed calls in the ring."""
    return {r.call: r.end - r.start for r in self._ring if r.end is not None}
