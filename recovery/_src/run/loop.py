"""The resilient training loop: steps, scheduled saves, preemption, Ctrl-C, stuck steps."""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import dataclasses
import functools
import time
from typing import Any

from absl import logging
import jax
import numpy as np

import multihost
from multihost import process_prefix as _prefix
from recovery._src.checkpoint.checkpoints import Checkpoints
from recovery._src.run import pending
from recovery._src.run.signals import SigintAsPreemption
from recovery._src.run.signals import SigtermFlag
from recovery._src.state import digest
from recovery._src.state.errors import RESUME_TO_CONTINUE
from recovery._src.state.errors import StepCheckError
from recovery._src.state.state import EpochSampler
from recovery._src.state.state import TransitionState

PyTree = Any
_monotonic = time.monotonic
_new = object.__new__
# (user_state, batch) -> (new_user_state, loss)
StepFn = Callable[[PyTree, PyTree], tuple[PyTree, Any]]
# sample ids -> batch (global arrays, identical on every controller)
DataFn = Callable[[np.ndarray], PyTree]
# (old_user_state, new_user_state, ids, loss) -> None; raises on a bad step.
CheckFn = Callable[[PyTree, PyTree, np.ndarray, float], None]


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """What one step did: its number (after the step), epoch, sample ids, loss.

  `raw_loss` is the loss as `step_fn` returned it: a jax.Array that the
  device may still be computing. `loss` reads it to the host as a float on
  first use (waiting for the step) and keeps it; nothing reads it unless
  asked.
  """
  step: int
  epoch: int
  ids: np.ndarray
  raw_loss: Any

  @functools.cached_property
  def loss(self) -> float:
    """The loss as a float (read once, on first use: waits for the step)."""
    return float(digest.host_value(self.raw_loss))


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
  exactly the steps the uninterrupted run would have taken. An optional
  `check_fn` checks each step independently; with `overlap_check`, `run`
  checks step n right after dispatching step n+1, so the device never waits
  for the check (a step's check still passes before it is saved or the run
  returns). Until step n's check has read its result, a process stuck in
  step n+1 is reported as stuck in step n (`multihost.step_watch()`'s
  `awaiting`). It is off by default: it needs a `step_fn` that donates none
  of its arguments (step n+1 would delete the state step n's check reads).
  """

  def __init__(self, step_fn: StepFn, *, data_fn: DataFn,
               sampler: EpochSampler, check_fn: CheckFn | None = None,
               overlap_check: bool = False):
    self.step_fn = step_fn
    self.data_fn = data_fn
    self.sampler = sampler
    self.check_fn = check_fn
    self.overlap_check = overlap_check

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
    return self._step(state, None, jax.process_count() > 1, True)

  def _step(self, state: TransitionState, watch: pending.Watch | None,
            many: bool, check: bool) -> tuple[TransitionState, StepRecord]:
    """`step`, marking on `watch` (a `multihost.step_watch()`) when the batch is loaded.

    `many`: whether there are several processes (`jax.process_count() > 1`).

    Dispatches the step and returns without waiting for it, except that
    with a `check_fn` and `check` the loss is read (the check decides
    whether the step stands), and a loss sharded across processes is read
    on every process here (reading it is collective).
    """
    ids, key, order, cursor, epoch = self.sampler._draw(state)  # pylint: disable=protected-access
    batch = self.data_fn(ids)
    if watch is not None:
      watch.arrived()  # From here on this process waits for its peers.
    user, loss = self.step_fn(state.user, batch)
    step = state.step + 1
    # The new state and StepRecord(...) without their __init__ (a frozen
    # dataclass's sets each field through object.__setattr__).
    nxt = state._with(user, key, order, cursor, epoch, step)  # pylint: disable=protected-access
    record = _new(StepRecord)
    record.__dict__.update(step=step, epoch=epoch, ids=ids, raw_loss=loss)
    if many and isinstance(loss, jax.Array) and not (
        loss.is_fully_addressable or loss.sharding.is_fully_replicated):
      _ = record.loss
    if check and self.check_fn is not None:
      # Read here, so that a report of a step stuck in this read shows the
      # program's own frames within its depth (one frame fewer than _check).
      _ = record.loss
      self._check(state.user, user, record)
    return nxt, record

  def _check(self, old_user: PyTree, new_user: PyTree,
             record: StepRecord) -> None:
    """Runs `check_fn` on `record`'s step.

    Raises:
      StepCheckError: the check failed (naming the step and its ids).
    """
    if self.check_fn is None:  # (callers check first)
      return
    try:
      self.check_fn(old_user, new_user, record.ids, record.loss)
    except AssertionError as e:
      raise StepCheckError(
          f'{_prefix()} Step {record.step} (sample ids '
          f'{record.ids.tolist()}) failed its independent check: {e}') from e

  def run(self, state: TransitionState, *, until_step: int,
          checkpoints: Checkpoints | None = None,
          on_step: Callable[[TransitionState, StepRecord], None] | None = None,
          handle_sigterm: bool = True,
          progress_every_s: float = 10.0,
          step_deadline: bool = True) -> RunResult:
    """Steps until `until_step`, saving on schedule and on preemption.

    Collective: every process must call this, in the same order.

    Saves every `checkpoints.save_every` steps and at `until_step`, each after a
    consistency check across controllers. After every step it asks
    `multihost.reached_preemption_sync_point(step)`: once any controller has
    received SIGTERM, all agree on a step, save it and return with
    `preempted=True`. A single controller without `jax.distributed` has no sync
    point, so with `handle_sigterm` the loop handles SIGTERM itself for the run,
    the same way. On Ctrl-C (KeyboardInterrupt) it lets a save in flight commit,
    then re-raises with notes (the step reached, the last committed checkpoint,
    how to continue). With several controllers the first Ctrl-C becomes a
    preemption notice (SIGTERM to this process: all stop at one agreed step and
    save it; an interrupted collective would leave the others waiting); a second
    interrupts at once.

    The host runs up to eight steps ahead (every fourth step it waits until
    four are queued): the device always has the next ones. A loss reaches
    the host only where used (`record.loss` read by `on_step`; a `check_fn`,
    before the next step is dispatched, with `overlap_check` right after; a
    progress line, the newest finished step's; the result). A saved step,
    the last, and a preemption's finish inside their step.

    The whole loop runs under `multihost.step_watch()` with no gap: a step
    (its batch, `step_fn`, its check, a wait for a queued step) and the
    code after it (`on_step`, the preemption check, the saves) count as
    that step (`StepWatch.between`). With several controllers, a process
    stuck anywhere in the loop past the step deadline (see
    `multihost.set_step_deadline`) makes every process log who is behind
    and where, and leave with exit status 75, so that a launcher or a
    scheduler restarts the job, which resumes from the last checkpoint.

    Args:
      state: the state to continue from (fresh or restored).
      until_step: the step to stop at.
      checkpoints: where to save; None to run without saving.
      on_step: called after every step with the new state and its record
        (reading `record.loss` or the state waits for the step).
      handle_sigterm: single controller only; see above.
      progress_every_s: seconds between progress log lines.
      step_deadline: False: no step deadline in this loop (for the process:
        `multihost.set_step_deadline(enabled=False)`).

    Returns: A `RunResult`.
    """
    many = jax.process_count() > 1
    sigterm = SigtermFlag() if handle_sigterm and not many else None
    progress = _Progress(state.step, until_step, progress_every_s)
    queue: pending.Queue[StepRecord] = pending.Queue()
    record: StepRecord | None = None
    watch = multihost.step_watch() if step_deadline else None
    checks = (pending.Overlapped(self._check, watch) if self.overlap_check and
              self.check_fn is not None else None)
    with _handlers(sigterm, SigintAsPreemption() if many else None):
      try:
        while state.step < until_step:
          n = state.step + 1
          settle = n == until_step or (checkpoints is not None
                                       and _saves_at(checkpoints, n))
          # No gap: `begin` ends the step before, judged until now.
          if watch is not None:
            watch.begin(n)
          state, record = self._step(old := state, watch, many,
                                     checks is None)
          if checks is not None:
            checks.dispatched(old.user, state.user, record, settle=settle)
          queue.add(record, settle)
          if watch is not None:
            watch.between()
          if on_step is not None:
            on_step(state, record)
          if (sigterm.received if sigterm is not None else
              many and multihost.reached_preemption_sync_point(state.step)):
            return _preempted(state, record, settle=settle, queue=queue,
                              watch=watch, checks=checks,
                              checkpoints=checkpoints)
          if checkpoints is not None:
            _save(checkpoints, state, preempted=False,
                  final=state.step == until_step)
          if _monotonic() >= progress.next_at:
            progress.tell(state.step, queue.done or record)
        if watch is not None:
          watch.end()
        if checkpoints is not None:
          checkpoints.wait()
        return RunResult(state=state, preempted=False,
                         last_loss=None if record is None else record.loss)
      except KeyboardInterrupt as interrupt:
        _end(watch, interrupt)
        _note_interrupt(interrupt, state, checkpoints)
        raise
      except BaseException as error:
        _end(watch, error)
        raise


def _end(watch: pending.Watch | None, error: BaseException) -> None:
  """Ends the watched window (`watch`'s step in progress, if any) on `error`: past its deadline, the step deadline's verdict comes first."""
  if watch is not None:
    watch.end(error)


def _preempted(state: TransitionState, record: StepRecord, *, settle: bool,
               queue: pending.Queue[StepRecord],
               watch: pending.Watch | None,
               checks: pending.Overlapped[StepRecord] | None,
               checkpoints: Checkpoints | None) -> RunResult:
  """At the agreed preemption step, `state`'s: finishes it (and its check), saves it, and says so."""
  if not settle:
    queue.finish(record, state, watch)
    if checks is not None:
      checks.flush()
  if checkpoints is not None:
    _save(checkpoints, state, preempted=True, final=False)
  if watch is not None:
    watch.end()
  _stopped_at_preemption(state, checkpoints)
  return RunResult(state=state, preempted=True, last_loss=record.loss)


@contextlib.contextmanager
def _handlers(sigterm: SigtermFlag | None,
              sigint: SigintAsPreemption | None):
  """The run's signal handlers, installed for its duration."""
  try:
    if sigterm is not None:
      sigterm.install()
    if sigint is not None:
      sigint.install()
    yield
  finally:
    if sigterm is not None:
      sigterm.uninstall()
    if sigint is not None:
      sigint.uninstall()


def _save(checkpoints: Checkpoints, state: TransitionState, *,
          preempted: bool, final: bool) -> None:
  """Saves `state` when a save is due: on schedule, at the end, at a preemption."""
  if preempted:
    checkpoints.save(state, force=True, reason='preemption')
  else:
    checkpoints.save(state, force=final,
                     reason='final' if final else 'scheduled')


def _saves_at(checkpoints: Checkpoints, step: int) -> bool:
  """Whether `checkpoints.save` writes at `step` by its schedule (either tier)."""
  local = checkpoints.local
  return step % checkpoints.save_every == 0 or (local is not None
                                                and local.due(step))


class _Progress:
  """The progress line, every `every_s` seconds (process 0 tells it for all).

  `next_at` (`time.monotonic()`) is when the next is due: the loop compares
  its clock with it, and calls `tell` only then.
  """

  def __init__(self, start_step: int, until_step: int, every_s: float):
    self._start, self._until, self._every = start_step, until_step, every_s
    self._t0 = _monotonic()
    self.next_at = self._t0 + every_s

  def tell(self, step: int, record: StepRecord) -> None:
    """Logs `record`'s step and loss (a finished step's: reading it leaves
    the device the queued steps' work) when the time has come."""
    now = _monotonic()
    if now < self.next_at:
      return
    self.next_at = now + self._every
    if jax.process_index() == 0:  # The loss and step are global.
      rate = (step - self._start) / (now - self._t0)
      logging.info('%s step %d/%d loss %.6g %.1f steps/s', _prefix(),
                   record.step, self._until, record.loss, rate)
