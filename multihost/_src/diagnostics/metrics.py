"""Diagnostics: each public collective's trace record and its `jax.monitoring` metrics; `record_event` for other spans.

`recorded(op, nbytes)` wraps a public collective: when it returns or
raises, it stamps `done` and the bytes on the flight records its
rendezvous began (see `runtime.flight`) and reports, through `jax.monitoring`
(where Orbax reports its saves, so the same listeners see both):

  /multihost/collective/duration_secs  the whole call (op=...)
  /multihost/collective/wait_secs      waiting for the others (op=...)
  /multihost/collective/bytes          payload bytes (a scalar, op=...)

Every event carries the same one metadata key, `op`, as
`jax.monitoring` asks (the same keys in the same order for an event). A
one-process call (no rendezvous) reports its duration, a wait of 0 and its
bytes. With no listener registered, each report is a loop over an empty
list.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import time
from typing import Any

import jax
from jax import monitoring
import numpy as np

from multihost._src.runtime import runtime

DURATION = '/multihost/collective/duration_secs'
WAIT = '/multihost/collective/wait_secs'
BYTES = '/multihost/collective/bytes'
EVENT = '/multihost/event/duration_secs'
EVENT_BYTES = '/multihost/event/bytes'


def recorded(op: str, nbytes: Callable[..., int] | None = None):
  """Decorates public collective `op`: trace record and metrics on every return or raise.

  Args:
    op: the collective's name (the metrics' `op`).
    nbytes: called with the call's arguments and its result, returns the
      payload bytes (default: 0 bytes).
  """

  def wrap(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
      rt = runtime.current()
      flight = rt.flight
      begun = flight.begun
      start = time.monotonic()
      try:
        result = fn(*args, **kwargs)
      except BaseException as e:
        _finish(flight, op, begun, start, 0, type(e).__name__)
        raise
      size = nbytes(result, *args, **kwargs) if nbytes is not None else 0
      _finish(flight, op, begun, start, size, '')
      return result
    return call
  return wrap


def _finish(flight, op: str, begun: int, start: float, size: int,
            error: str) -> None:
  done = time.monotonic()
  wait = 0.0
  first = True
  for record in flight.since(begun):
    if record.done is None:  # Not an inner collective's (already done).
      record.done = done
      if error and record.error is None:  # `Recorder.fail` may have named it.
        record.failed_at = done  # before `error`: see `Recorder.fail`
        record.error = error
      if first:  # The payload is the collective's own meeting's.
        record.nbytes = size
        first = False
      if record.end is not None:
        wait += record.end - record.start
  monitoring.record_event_duration_secs(DURATION, done - start, op=op)
  monitoring.record_event_duration_secs(WAIT, wait, op=op)
  monitoring.record_scalar(BYTES, size, op=op)


def record_event(name: str, start: float, end: float | None = None,
                 **args: Any) -> None:
  """Records a span of this process (e.g. a checkpoint save) on its trace and in `jax.monitoring`.

  Not a collective: only this process records it. It appears on this
  process's track of the merged trace (`multihost.launch --trace`,
  `multihost.write_trace`) with `args`, and is reported as
  /multihost/event/duration_secs with metadata name=`name`; with a
  `bytes` argument also as the scalar /multihost/event/bytes with metadata
  name=`name`, tier=`args['tier']` ('' when not given).

  Args:
    name: what happened ('checkpoint save', 'checkpoint restore', ...).
    start: when it began, time.monotonic() seconds.
    end: when it ended, time.monotonic() seconds (default: now).
    **args: details shown with the event (JSON-able values).
  """
  if end is None:
    end = time.monotonic()
  runtime.current().flight.event(name, start, end, args)
  monitoring.record_event_duration_secs(EVENT, end - start, name=name)
  if 'bytes' in args:
    monitoring.record_scalar(EVENT_BYTES, args['bytes'], name=name,
                             tier=str(args.get('tier', '')))


def result_bytes(result: Any, *args: Any, **kwargs: Any) -> int:
  """The bytes of a collective's result's array leaves (0 for others)."""
  del args, kwargs
  if type(result) is np.ndarray:  # (one leaf, the common case: no flatten)
    return result.nbytes
  return sum(getattr(x, 'nbytes', 0) for x in jax.tree.leaves(result))
