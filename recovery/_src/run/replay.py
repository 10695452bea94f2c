"""Checks that a run restored from a checkpoint replays the uninterrupted one."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import numpy as np

from multihost import process_prefix as _prefix
from recovery._src.state import digest
from recovery._src.state.errors import ReplayMismatchError
from recovery._src.state.state import TransitionState

# The tutorial's tolerances for comparisons across runs.
RTOL = 2e-5
ATOL = 2e-6


class StepResult(Protocol):
  """What `verify_replay` reads of one step's record (a `StepRecord` has it)."""
  step: int
  ids: np.ndarray
  loss: float


class Stepper(Protocol):
  """What `verify_replay` needs of a loop (a `ResilientLoop` is one).

  `step` takes one step from a state: it draws the next batch, runs the
  step function and returns the new state with what the step did.
  """

  def step(self, state: TransitionState) -> tuple[TransitionState,
                                                  StepResult]:
    ...


@dataclasses.dataclass(frozen=True)
class ReplayStep:
  """One compared step of a replay."""
  step: int
  ids: np.ndarray
  reference_loss: float
  replayed_loss: float


def verify_replay(loop: Stepper, reference: TransitionState,
                  restored: TransitionState, num_steps: int, *,
                  rtol: float = RTOL, atol: float = ATOL) -> list[ReplayStep]:
  """Checks that `num_steps` steps from a restored state replay the original.

  Collective: every process must call this, in the same order.

  `reference` is the uninterrupted run's state at the checkpointed step and
  `restored` the state read back from the checkpoint. The restored state must
  equal the reference bitwise; then both are advanced side by side and, at
  every step, the sample ids must be identical and the losses and every leaf
  of the state equal within (rtol, atol). The replay crosses epoch
  boundaries as the original run did.

  Args:
    loop: what takes a step (e.g. the `ResilientLoop` both runs use).
    reference: the uninterrupted run's state at the checkpointed step.
    restored: the state restored from that checkpoint.
    num_steps: number of steps to replay.
    rtol: relative tolerance for losses and state leaves.
    atol: absolute tolerance for losses and state leaves.

  Returns:
    One `ReplayStep` per replayed step.

  Raises:
    ReplayMismatchError: naming the step and what differed.
  """
  if num_steps < 1:
    raise ValueError(f'num_steps must be >= 1; got {num_steps}.')
  ref_digests = digest.checkpoint_leaf_digests(reference.to_tree())
  got_digests = digest.checkpoint_leaf_digests(restored.to_tree())
  differ = sorted(k for k in ref_digests
                  if ref_digests[k] != got_digests.get(k))
  if differ or ref_digests.keys() != got_digests.keys():
    raise ReplayMismatchError(
        f'{_prefix()} The restored state at step '
        f'{restored.step} differs from the saved one in leaves {differ}. The '
        'checkpoint did not round-trip; check the restore target.')
  out = []
  for _ in range(num_steps):
    reference, ref_rec = loop.step(reference)
    restored, rec = loop.step(restored)
    where = f'{_prefix()} Replay step {rec.step}'
    if not np.array_equal(ref_rec.ids, rec.ids):
      raise ReplayMismatchError(
          f'{where}: sample ids differ: uninterrupted run '
          f'{ref_rec.ids.tolist()}'
          f', replay {rec.ids.tolist()}. The data order is not carried '
          'exactly (key, order, cursor, epoch).')
    if not np.allclose(rec.loss, ref_rec.loss, rtol=rtol, atol=atol):
      raise ReplayMismatchError(
          f'{where}: loss {rec.loss!r} differs from the uninterrupted run\'s '
          f'{ref_rec.loss!r} (rtol={rtol}, atol={atol}).')
    ref_host = digest.host_tree(reference.to_tree())
    got_host = digest.host_tree(restored.to_tree())
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ref_host)[0],
                            jax.tree.leaves(got_host), strict=True):
      if a.shape != b.shape or not np.allclose(b, a, rtol=rtol, atol=atol):
        err = (np.max(np.abs(b.astype(np.float64) - a))
               if a.shape == b.shape else None)
        raise ReplayMismatchError(
            f'{where}: state leaf {digest.path_name(path)} differs from the '
            f'uninterrupted run (max abs difference {err}, rtol={rtol}, '
            f'atol={atol}).')
    out.append(ReplayStep(rec.step, rec.ids, ref_rec.loss, rec.loss))
  return out
