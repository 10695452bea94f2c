"""The steps `ResilientLoop.run` has dispatched and not yet waited for, and the step check it holds back (`overlap_check`)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any
from typing import Generic
from typing import Protocol
from typing import TypeVar

import jax

# How far `ResilientLoop.run` lets the host run ahead of the device: it
# waits once every EVERY steps, for the step KEEP before the newest, so that
# between KEEP and KEEP + EVERY steps stay queued (the device always has the
# next ones). Asking the runtime whether a step is done is what costs: on a
# TPU v5e host about 30 us for a step that has just finished and 9 for one
# eight steps back (a trivial step's dispatch: 170 us), so it asks rarely,
# about a step some way back.
KEEP = 4
EVERY = 4


class Record(Protocol):
  """A dispatched step (`loop.StepRecord`): its number and its loss as the step function returned it (a jax.Array, or any value)."""

  @property
  def step(self) -> int: ...
  @property
  def raw_loss(self) -> Any: ...  # Whatever the user's step function returned.


# The records a queue holds (the loop's own `StepRecord`).
R = TypeVar('R', bound=Record)


class Watch(Protocol):
  """The part of `multihost.step_watch()` these use."""

  def begin(self, n: int) -> None: ...
  def arrived(self) -> None: ...
  def between(self) -> None: ...
  def end(self, error: BaseException | None = None) -> None: ...
  def awaiting(self, n: int | None,
               ready: Callable[[], bool] | None = None) -> None: ...


class State(Protocol):
  """The transition state (`TransitionState`): its user state is waited for."""

  @property
  def user(self) -> Any: ...  # The user's pytree.


# A held check: (old user state, new user state, record).
Check = Callable[[Any, Any, R], None]


class Overlapped(Generic[R]):
  """`overlap_check`: the check of the step dispatched last, run once the next one is dispatched (or when flushed)."""

  def __init__(self, check: Check[R], watch: Watch | None):
    self._check = check
    self._watch = watch  # A `multihost.step_watch()`, or None.
    self._held: tuple[Any, Any, R] | None = None

  def dispatched(self, old_user: Any, new_user: Any,
                 record: R, *, settle: bool) -> None:
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
      # jax.Array's annotations leave out `is_ready`, which arrays have.
      self._watch.awaiting(record.step, loss.is_ready if isinstance(  # type: ignore[attr-defined]
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


class Queue(Generic[R]):
  """The steps dispatched and not yet waited for, oldest first.

  A loop that never reads a result keeps the device busy by queueing steps
  ahead of it; this one queues up to KEEP + EVERY, so that what is queued
  stays bounded and a stuck step holds up the host within a few steps (its
  watched time is then device time).
  """

  def __init__(self):
    self._steps: collections.deque[R] = collections.deque()
    self.done: R | None = None  # The newest step known finished.
    # The type of the last loss seen to be a jax.Array: an isinstance check
    # against jax.Array costs about as much as asking whether it is ready.
    self._array_type: type | None = None

  def add(self, record: R, settle: bool) -> None:
    """Queues `record`'s step; at KEEP + EVERY queued waits until KEEP are (with `settle`: none)."""
    steps = self._steps
    steps.append(record)
    if settle:
      keep = 0
    elif len(steps) >= KEEP + EVERY:
      keep = KEEP
    else:
      return
    while len(steps) > keep + 1:
      # Finished before the one waited for, which reads their state.
      steps.popleft()
    done = steps.popleft()
    loss = done.raw_loss
    if type(loss) is self._array_type or isinstance(loss, jax.Array):
      self._array_type = type(loss)
      # Mostly finished already (the host is the slower side): asking
      # spares the wait's round trip through the runtime. (mypy cannot
      # follow the cached type check to jax.Array, whose annotations leave
      # out `is_ready`.)
      if not loss.is_ready():  # type: ignore[attr-defined]
        loss.block_until_ready()  # type: ignore[attr-defined]
    else:
      jax.block_until_ready(loss)
    self.done = done

  def finish(self, record: R, state: State,
             watch: Watch | None) -> None:
    """Waits for `record`'s step (its loss and `state`) and all before it, judged as its step."""
    self._steps.clear()
    if watch is None:
      jax.block_until_ready((record.raw_loss, state.user))
    else:  # The step's end, still judged (its window stays open).
      watch.begin(record.step)
      watch.arrived()
      jax.block_until_ready((record.raw_loss, state.user))
      watch.between()
    self.done = record
