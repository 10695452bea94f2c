"""The resilient training loop: steps, scheduled saves, preemption, Ctrl-C, stuck steps."""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import time
from typing import Any

from absl import logging
import jax
import numpy as np

import multihost
from multihost.lowlevel import process_prefix as _prefix
from recovery._src.checkpoint.checkpoints import Checkpoints
from recovery._src.run.signals import SigintAsPreemption
from recovery._src.run.signals import SigtermFlag
from recovery._src.state import digest
from recovery._src.state.errors import RESUME_TO_CONTINUE
from recovery._src.state.errors import StepCheckError
from recovery._src.state.state import EpochSampler
from recovery._src.state.state import TransitionState

PyTree = Any
# (user_state, batch) -> (new_user_state, loss)
StepFn = Callable[[PyTree, PyTree], tuple[PyTree, Any]]
# sample ids -> batch (global arrays, identical on every controller)
DataFn = Callable[[np.ndarray], PyTree]
# (old_user_state, new_user_state, ids, loss) -> None; raises on a bad step.
CheckFn = Callable[[PyTree, PyTree, np.ndarray, float], None]


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """What one step did: its number (after the step), epoch, sample ids, loss."""
  step: int
  epoch: int
  ids: np.ndarray
  loss: float


@dataclasses.dataclass(frozen=True)
class RunResult:
  """How `ResilientLoop.run` ended.

  Attributes:
    state: the state after the last step taken.
    preempted: True when the run stopped at an agreed preemption step (after
      saving it, when checkpoints are configured).
    last_loss: the loss of the last step taken, or None when no step ran.
  """
  state: TransitionState
  preempted: bool
  last_loss: float | None = None


def _stopped_at_preemption(state: TransitionState,
                           checkpoints: Checkpoints | None) -> None:
  """Once every controller stopped at `state`'s step for a preemption: waits for its save, and says so."""
  if checkpoints is not None:
    checkpoints.wait()
    where = (f'saved checkpoint step {state.step} in '
             f'{checkpoints.directory}')
  else:
    where = 'no checkpoint folder, nothing saved'
  logging.warning(
      '%s Preemption: all controllers stopped at step %d; %s. '
      'Exiting. %s', _prefix(), state.step, where,
      RESUME_TO_CONTINUE)


def _note_interrupt(interrupt: KeyboardInterrupt, state: TransitionState,
                    checkpoints: Checkpoints | None) -> None:
  """On Ctrl-C: lets a save in flight commit, then adds to `interrupt` the step reached, the last committed checkpoint and how to continue."""
  latest = None
  if checkpoints is not None:
    try:
      checkpoints.wait()
      latest = checkpoints.latest_step()
    except Exception:  # pylint: disable=broad-except
      logging.exception('%s Waiting for the save in flight failed.',
                        _prefix())
  # Notes, not a log line: the interrupt's one message, shown with it
  # where it is not caught, or by the program that catches it (what
  # happened first, then how to continue in recovery's terms).
  told = (f'{_prefix()} Interrupted (Ctrl-C) after step {state.step}; '
          f'the last committed checkpoint is step {latest}.')
  if hasattr(interrupt, 'add_note'):
    interrupt.add_note(told)
    interrupt.add_note(RESUME_TO_CONTINUE)
  else:  # Python 3.10: no notes.
    logging.warning('%s %s', told, RESUME_TO_CONTINUE)


class ResilientLoop:
  """Runs a user's step function over a deterministic data order, resumably.

  The user provides a jitted `step_fn(user_state, batch) -> (user_state,
  loss)`, a `data_fn(ids) -> batch` that builds the batch for the given
  sample ids (the same ids on every controller), and an `EpochSampler`. The
  loop carries the complete `TransitionState` (user state, PRNG key, data
  order, cursor, epoch, step), so a run restored from a checkpoint takes
  exactly the steps the uninterrupted run would have taken.
  """

  def __init__(self, step_fn: StepFn, *, data_fn: DataFn,
               sampler: EpochSampler, check_fn: CheckFn | None = None):
    self.step_fn = step_fn
    self.data_fn = data_fn
    self.sampler = sampler
    self.check_fn = check_fn

  def init(self, user_state: PyTree, key: jax.Array) -> TransitionState:
    """The state at step 0: `user_state`, first epoch's order from `key`."""
    if not (isinstance(key, jax.Array)
            and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)):
      raise TypeError(
          f'key must be a typed PRNG key from jax.random.key(seed); got '
          f'{type(key).__name__} with dtype {getattr(key, "dtype", None)}.')
    key, order = self.sampler.start(key)
    return TransitionState(user=user_state, key=key, order=order, cursor=0,
                           epoch=0, step=0)

  def step(self, state: TransitionState) -> tuple[TransitionState, StepRecord]:
    """Takes one step: draws the next batch, runs `step_fn`, checks it.

    Collective when `step_fn` or `data_fn` are (as on a multi-process mesh):
    every process must call this, in the same order.
    """
    return self._step(state, None)

  def _step(self, state: TransitionState, watch: Any
            ) -> tuple[TransitionState, StepRecord]:
    """`step`, marking on `watch` (a `multihost.step_watch()`) when the batch is loaded."""
    ids, nxt = self.sampler.next(state)
    batch = self.data_fn(ids)
    if watch is not None:
      watch.arrived()  # From here on this process waits for its peers.
    user, loss = self.step_fn(state.user, batch)
    loss = float(digest.host_value(loss))
    if self.check_fn is not None:
      try:
        self.check_fn(state.user, user, ids, loss)
      except AssertionError as e:
        raise StepCheckError(
            f'{_prefix()} Step {state.step + 1} (sample ids {ids.tolist()}) '
            f'failed its independent check: {e}') from e
    nxt = nxt.replace(user=user, step=state.step + 1)
    return nxt, StepRecord(step=nxt.step, epoch=nxt.epoch, ids=ids, loss=loss)

  def run(self, state: TransitionState, *, until_step: int,
          checkpoints: Checkpoints | None = None,
          on_step: Callable[[TransitionState, StepRecord], None] | None = None,
          handle_sigterm: bool = True,
          progress_every_s: float = 10.0,
          step_deadline: bool = True) -> RunResult:
    """Steps until `until_step`, saving on schedule and on preemption.

    Collective: every process must call this, in the same order.

    Saves every `checkpoints.save_every` steps and at `until_step`, each after
    a consistency check across controllers. After every step it asks
    `multihost.reached_preemption_sync_point(step)`: once any controller has
    received SIGTERM, all controllers agree on a step, save it and return
    with `preempted=True`. A single controller without `jax.distributed` has
    no sync point (it is always False there and SIGTERM would kill the
    process), so with `handle_sigterm` the loop installs its own SIGTERM
    handler for the duration of the run and treats the signal the same way.
    On Ctrl-C (KeyboardInterrupt) it lets a save in flight commit, then
    re-raises with notes (the step reached and the last committed
    checkpoint, then how to continue); the last committed checkpoint is
    never touched. With several controllers, a Ctrl-C lands at a different
    point of the loop on each, so an interrupted collective (a save) would
    leave the others waiting: there the first Ctrl-C is turned into a preemption notice (SIGTERM to this
    process), so that every controller stops at one agreed step and saves it;
    a second Ctrl-C interrupts at once.

    Each step (its batch, `step_fn`, its check; not the saves or
    `on_step`) runs under `multihost.step_watch()`, which marks the arrival
    after `data_fn`. With several controllers, a step stuck past its
    deadline (learned from the step times, see `multihost.set_step_deadline`)
    makes every process log who is behind and where, and leave with exit
    status 75, so that the launcher's `--max_restarts` or a scheduler
    restarts the job, which resumes here from the last checkpoint.

    Args:
      state: the state to continue from (fresh or restored).
      until_step: the step to stop at.
      checkpoints: where to save; None to run without saving.
      on_step: called after every step with the new state and its record.
      handle_sigterm: single controller only; see above.
      progress_every_s: seconds between progress log lines.
      step_deadline: False: no step deadline in this loop (or turn it off
        for the process: `multihost.set_step_deadline(enabled=False)`,
        $MULTIHOST_STEP_DEADLINE=off).

    Returns:
      A `RunResult`.
    """
    sigterm = SigtermFlag() if (handle_sigterm
                                 and jax.process_count() == 1) else None
    sigint = SigintAsPreemption() if jax.process_count() > 1 else None
    start_step, t0 = state.step, time.monotonic()
    record = None
    last_log = t0
    watch = multihost.step_watch() if step_deadline else None
    try:
      if sigterm is not None:
        sigterm.install()
      if sigint is not None:
        sigint.install()
      while state.step < until_step:
        if watch is None:
          state, record = self.step(state)
        else:
          with watch.step(state.step + 1):
            state, record = self._step(state, watch)
        if on_step is not None:
          on_step(state, record)
        preempted = self._reached_preemption(state.step, sigterm)
        if checkpoints is not None:
          if preempted:
            checkpoints.save(state, force=True, reason='preemption')
          else:
            final = state.step == until_step
            checkpoints.save(state, force=final,
                             reason='final' if final else 'scheduled')
        if preempted:
          _stopped_at_preemption(state, checkpoints)
          return RunResult(state=state, preempted=True, last_loss=record.loss)
        now = time.monotonic()
        if now - last_log >= progress_every_s:
          # The loss and step are global: process 0 tells them for all.
          if jax.process_index() == 0:
            rate = (state.step - start_step) / (now - t0)
            logging.info('%s step %d/%d loss %.6g %.1f steps/s', _prefix(),
                         state.step, until_step, record.loss, rate)
          last_log = now
      if checkpoints is not None:
        checkpoints.wait()
      return RunResult(state=state, preempted=False,
                       last_loss=None if record is None else record.loss)
    except KeyboardInterrupt as interrupt:
      _note_interrupt(interrupt, state, checkpoints)
      raise
    finally:
      if sigterm is not None:
        sigterm.uninstall()
      if sigint is not None:
        sigint.uninstall()

  def _reached_preemption(self, step: int,
                          sigterm: SigtermFlag | None) -> bool:
    if sigterm is not None:
      return sigterm.is_set()
    if jax.process_count() == 1:
      return False
    return multihost.reached_preemption_sync_point(step)
