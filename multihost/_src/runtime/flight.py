"""Runtime: the flight recorder, each process's bounded ring of its last collective calls and events.

Every rendezvous (see `control.rendezvous`) appends one `Record` when it
starts and stamps its `end` when every process has met, or its `error` when
the call raised here (a timeout, a failed peer): either way the call is over
for this process, and `in_progress` no longer names it. The public
collective then stamps `done` and the bytes it moved (see `diagnostics.metrics`), so a
record tells the time spent waiting for the others (`end - start`) from the
time spent moving data (`done - end`). That costs a few clock reads and one
small object per call; nothing here blocks or talks to another process.
`diagnostics.where` reads the ring to say what a process last did;
`straggler_report()` compares the waits across processes: everyone leaves a
meeting at about the same moment, so the process that waited least came
last, and the largest wait minus the smallest is by how much.

Events (checkpoint saves, restores, restarts: `record_event`) go to a second
ring of the same size. `dump()` writes both rings, with this process's clock
anchors, as one JSON file; the launcher (`--trace`) and `write_trace` merge
such dumps into a timeline (see `diagnostics.trace_format`). The size of each ring is
$MULTIHOST_FLIGHT_RING (default 64).
"""

from __future__ import annotations

import collections
import json
import os
import time
from typing import Any

from multihost._src.runtime import files
from multihost._src.runtime import settings


class Record:
  """One collective call: op, barrier name, call number, its times (time.monotonic()) and bytes.

  `start`: the rendezvous began; `end`: every process had met (None: not
  yet); `done`: the collective returned or raised (None: not yet);
  `nbytes`: the payload bytes it moved; `error`: the exception's class name
  when it raised here (None: it did not), `failed_at` when, and `missing`
  the processes a timeout waited for in vain (then `end` stays None: the
  processes did not all meet).
  """

  __slots__ = ('op', 'name', 'call', 'start', 'end', 'done', 'nbytes',
               'error', 'failed_at', 'missing')

  def __init__(self, op: str, name: str, call: int, start: float):
    self.op = op
    self.name = name
    self.call = call
    self.start = start
    self.end: float | None = None
    self.done: float | None = None
    self.nbytes = 0
    self.error: str | None = None
    self.failed_at: float | None = None
    self.missing: tuple[int, ...] = ()  # Of a timeout: who did not come.

  def label(self) -> str:
    """'sync_global_devices('step 3') (call 12)', or 'process_allgather (call 13)'."""
    name = f'({self.name!r})' if self.name else ''
    return f'{self.op}{name} (call {self.call})'

  def as_dict(self) -> dict[str, Any]:
    return {s: getattr(self, s) for s in self.__slots__}


class Recorder:
  """One process's rings of its last calls and events (see the module docstring).

  Args:
    size: calls (and events) kept (default: $MULTIHOST_FLIGHT_RING, else 64).
  """

  __slots__ = ('_ring', '_events', 'begun', 'wall0', 'mono0')

  def __init__(self, size: int | None = None):
    size = settings.flight_ring() if size is None else size
    self._ring: collections.deque[Record] = collections.deque(maxlen=size)
    self._events: collections.deque[tuple] = collections.deque(maxlen=size)
    self.begun = 0  # Records begun so far (the ring keeps the last `size`).
    # One clock reading of each kind, to place monotonic times on the wall
    # clock in a dump.
    self.wall0 = time.time()
    self.mono0 = time.monotonic()

  @property
  def size(self) -> int:
    return self._ring.maxlen or 0

  def begin(self, op: str, call: int, start: float, name: str = '') -> Record:
    """Records the start of call `call` of collective `op` (at `start`)."""
    record = Record(op, name, call, start)
    self._ring.append(record)
    self.begun += 1
    return record

  @staticmethod
  def end(record: Record) -> None:
    """Records that every process met in `record`'s call."""
    record.end = time.monotonic()

  @staticmethod
  def fail(record: Record, error: BaseException) -> None:
    """Records that `record`'s call raised `error` here (it is over for this process)."""
    if record.end is None and record.error is None:
      # `error` last: other threads (the where-responder) read a record as
      # failed once `error` is set, and then read the other two.
      record.failed_at = time.monotonic()
      record.missing = tuple(getattr(error, 'missing', None) or ())
      record.error = type(error).__name__

  def since(self, begun: int) -> list[Record]:
    """The records begun after `begun` records had been (those still in the ring)."""
    n = min(self.begun - begun, len(self._ring))
    if n <= 0:
      return []
    ring = self._ring  # (not a copy of the whole ring: every call asks)
    return [ring[-k] for k in range(n, 0, -1)]

  def event(self, name: str, start: float, end: float,
            args: dict[str, Any]) -> None:
    """Records a span (time.monotonic() start and end) named `name`."""
    self._events.append((name, start, end, args))

  def records(self) -> list[Record]:
    """The last calls, oldest first (a copy)."""
    return list(self._ring)

  def events(self) -> list[tuple]:
    """The last events (name, start, end, args), oldest first (a copy)."""
    return list(self._events)

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

  def snapshot(self, process: int, **extra: Any) -> dict[str, Any]:
    """This process's rings as plain data, times on its wall clock (seconds)."""
    shift = self.wall0 - self.mono0

    def wall(t):
      return None if t is None else t + shift

    records = []
    for r in list(self._ring):
      d = r.as_dict()
      for k in ('start', 'end', 'done'):
        d[k] = wall(d[k])
      records.append(d)
    events = [{'name': n, 'start': wall(s), 'end': wall(e), 'args': a}
              for n, s, e, a in list(self._events)]
    return {'process': process, 'pid': os.getpid(), 'dumped': time.time(),
            'ring': self.size, 'begun': self.begun, 'records': records,
            'events': events, **extra}

  def dump(self, path: str, process: int, **extra: Any) -> None:
    """Writes `snapshot()` to `path` as JSON, atomically and never through a link (`files.write_atomic`).

    Not flushed to disk: it is written in the exit sequence, for a reader on
    this host after the exit (the launcher), whom the page cache serves.
    """
    data = self.snapshot(process, **extra)
    files.write_atomic(path, json.dumps(data, default=repr), sync=False)
