"""The steps `ResilientLoop.run` has dispatched and not yet waited for, and the step check it holds back (`overlap_check`)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax

# Steps `ResilientLoop.run` lets the device queue before it waits for the
# oldest (two: the next step is always queued, with one to spare for a slow
# batch on the host).
IN_FLIGHT = 2


class Overlapped:
  """`overlap_check`: the check of the step dispatched last, run once the next one is dispatched (or when flushed)."""

  def __init__(self, check: Callable[[Any, Any, Any], None], watch: Any):
    self._check = check  # (old user state, new user state, record)
    self._watch = watch  # A `multihost.step_watch()`, or None.
    self._held: tuple[Any, Any, Any] | None = None

  def dispatched(self, old_user: Any, new_user: Any,
                 record: Any, *, settle: bool) -> None:
    """Checks the step held before `record`'s, then holds `record`'s (checked now with `settle`)."""
    self.flush()
    self._held = (old_user, new_user, record)
    if settle:
      self.flush()
    elif self._watch is not None:
      # Until its check has read it, a process stuck in the next step is
      # stuck on this one's result (the check reads it; on a CPU device the
      # next step's batch and dispatch can wait for it too).
      loss = record.raw_loss
      self._watch.awaiting(record.step, loss.is_ready if isinstance(
          loss, jax.Array) else None)

  def flush(self) -> None:
    """Checks the step held, if any."""
    held, self._held = self._held, None
    if held is not None:
      try:
        self._check(*held)
      finally:
        if self._watch is not None:
          self._watch.awaiting(None)


class Queue:
  """The steps dispatched and not yet waited for, oldest first.

  A loop that never reads a result keeps the device busy by queueing steps
  ahead of it; this one queues up to `IN_FLIGHT`, so that a step's watched
  time is its device time and what is queued stays bounded.
  """

  def __init__(self):
    self._steps: collections.deque[Any] = collections.deque()
    self.done: Any = None  # The newest step known finished.
    # The type of the last loss seen to be a jax.Array: an isinstance check
    # against jax.Array costs about as much as asking whether it is ready.
    self._array_type: type | None = None

  def add(self, record: Any, settle: bool) -> None:
    """Queues `record`'s step; waits for the oldest while over `IN_FLIGHT` (all with `settle`)."""
    steps = self._steps
    steps.append(record)
    while len(steps) > IN_FLIGHT or (settle and steps):
      done = steps.popleft()
      loss = done.raw_loss
      if type(loss) is self._array_type or isinstance(loss, jax.Array):
        self._array_type = type(loss)
        # Mostly finished already (the host is the slower side): asking
        # spares the wait's round trip through the runtime.
        if not loss.is_ready():
          loss.block_until_ready()
      else:
        jax.block_until_ready(loss)
      self.done = done

  def finish(self, record: Any, state: Any,
             watch: Any) -> None:
    """Waits for `record`'s step (its loss and `state`) and all before it, judged as its step."""
    self._steps.clear()
    if watch is None:
      jax.block_until_ready((record.raw_loss, state.user))
    else:
      with watch.step(record.step):  # The step's end, still judged.
        watch.arrived()
        jax.block_until_ready((record.raw_loss, state.user))
    self.done = record
