"""Checks that every controller holds an identical transition state."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import multihost
from recovery import _digest
from recovery import _leaves
from recovery._state import TransitionState

PyTree = Any


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
  tree = _leaves.storable(tree)
  if digests is None:
    digests = _digest.checkpoint_leaf_digests(tree)
  if jax.process_count() > 1:
    # Comparing each leaf's digest is comparing the leaf, at 16 bytes a leaf.
    # A leaf sharded across processes has one digest combined from every
    # process's shards, which would hide replicas that differ: then compare
    # the tree itself, shard by shard (digests of each process's own shards;
    # nothing is gathered).
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
