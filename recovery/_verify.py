"""Consistency checks across controllers, and replay verification."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

import multihost
from recovery import _digest
from recovery._state import TransitionState

if TYPE_CHECKING:
  from recovery._loop import ResilientLoop

PyTree = Any

# The tutorial's tolerances for comparisons across runs.
RTOL = 2e-5
ATOL = 2e-6


class ReplayMismatchError(AssertionError):
  """A replay from a checkpoint diverged from the uninterrupted run."""


def check_consistent(state: TransitionState | PyTree, *, what: str,
                     timeout: float | None = None,
                     digests: dict[str, str] | None = None) -> dict[str, str]:
  """Checks that every controller holds an identical transition state.

  Collective: every process must call this, in the same order.

  `multihost.assert_equal` compares every leaf of the whole state (user
  state, PRNG key data, data order, cursor, epoch, step) across processes, by
  its digest, so a mismatch raises on every process, naming the leaf paths
  and the processes that differ.

  Args:
    state: a `TransitionState` or an already flattened checkpoint tree.
    what: the moment of the check, used in the error ('before saving step 8').
    timeout: seconds to wait for the other processes.
    digests: this process's leaf digests of `state`, if already computed.

  Returns:
    This process's leaf digests, by leaf path.

  Raises:
    multihost.ConsistencyError: the controllers hold different states.
  """
  tree = state.to_tree() if isinstance(state, TransitionState) else state
  if digests is None:
    digests = _digest.leaf_digests(tree)
  if jax.process_count() > 1:
    # Comparing each leaf's digest is comparing the leaf, at 16 bytes a leaf.
    # A leaf sharded across processes has one digest of its gathered value,
    # which would hide replicas that differ: then compare the tree itself
    # (shard by shard).
    sharded = any(isinstance(x, jax.Array) and not x.is_fully_addressable
                  and not x.is_fully_replicated for x in jax.tree.leaves(tree))
    compared = tree if sharded else {
        name: np.frombuffer(bytes.fromhex(d), np.uint8)
        for name, d in digests.items()}
    multihost.assert_equal(
        compared,
        f'{what}: the controllers hold different transition states. Every '
        'controller must run the same step function on the same data from '
        'the same restored state; look for process-dependent randomness, data '
        'or code behind the differing leaves.',
        timeout=timeout)
  return digests


@dataclasses.dataclass(frozen=True)
class ReplayStep:
  """One compared step of a replay."""
  step: int
  ids: np.ndarray
  reference_loss: float
  replayed_loss: float


def verify_replay(loop: ResilientLoop, reference: TransitionState,
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
    loop: the loop whose step function, sampler and data both runs use.
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
  ref_digests = _digest.leaf_digests(reference.to_tree())
  got_digests = _digest.leaf_digests(restored.to_tree())
  differ = sorted(k for k in ref_digests
                  if ref_digests[k] != got_digests.get(k))
  if differ or ref_digests.keys() != got_digests.keys():
    raise ReplayMismatchError(
        f'[process={jax.process_index()}] The restored state at step '
        f'{restored.step} differs from the saved one in leaves {differ}. The '
        'checkpoint did not round-trip; check the restore target.')
  out = []
  for _ in range(num_steps):
    reference, ref_rec = loop.step(reference)
    restored, rec = loop.step(restored)
    where = f'[process={jax.process_index()}] Replay step {rec.step}'
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
    ref_host = _digest.host_tree(reference.to_tree())
    got_host = _digest.host_tree(restored.to_tree())
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ref_host)[0],
                            jax.tree.leaves(got_host), strict=True):
      if a.shape != b.shape or not np.allclose(b, a, rtol=rtol, atol=atol):
        err = (np.max(np.abs(b.astype(np.float64) - a))
               if a.shape == b.shape else None)
        raise ReplayMismatchError(
            f'{where}: state leaf {_digest.path_name(path)} differs from the '
            f'uninterrupted run (max abs difference {err}, rtol={rtol}, '
            f'atol={atol}).')
    out.append(ReplayStep(rec.step, rec.ids, ref_rec.loss, rec.loss))
  return out
