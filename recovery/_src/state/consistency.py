"""Checks that every controller holds an identical transition state."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

import multihost
from recovery._src.state import digest as _digest
from recovery._src.state import leaves
from recovery._src.state.state import TransitionState

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
  tree = leaves.storable(tree)
  if digests is None:
    digests = _digest.checkpoint_leaf_digests(tree)
  if jax.process_count() > 1:
    # Comparing each leaf's digest is comparing the leaf, at 16 bytes a leaf.
    # A leaf sharded across processes has one digest combined from every
    # process's shards (the same on every process by construction): when
    # parts of it are held by several processes, those replicas could differ
    # unseen, so such a leaf is compared shard by shard (digests of each
    # process's own shards; nothing is gathered). A leaf whose every part is
    # held by one process only has nothing to compare beyond its digest.
    compared = {}
    for (name, digest), x in zip(digests.items(), jax.tree.leaves(tree),
                                 strict=True):
      compared[name] = (x if _replicated_across_processes(x)
                        else np.frombuffer(bytes.fromhex(digest), np.uint8))
    multihost.assert_equal(
        compared,
        f'{what}: the controllers hold different transition states. Every '
        'controller must run the same step function on the same data from '
        'the same restored state; look for process-dependent randomness, data '
        'or code behind the differing leaves.',
        timeout=timeout)
  return digests


def _replicated_across_processes(x: Any) -> bool:
  """Whether `x` is sharded across processes with some part on several."""
  return (leaves.is_split_across_processes(x)
          and _has_cross_process_replicas(x.sharding, x.shape))


@functools.lru_cache(maxsize=256)
def _has_cross_process_replicas(sharding: jax.sharding.Sharding,
                                shape: tuple[int, ...]) -> bool:
  holders: dict[tuple, set[int]] = {}
  for device, index in sharding.devices_indices_map(shape).items():
    key = tuple((s.start, s.stop, s.step) for s in index)
    # jax's `Device` (jaxlib's) does not resolve for mypy (it reports an
    # unresolved `Device?`); the attribute exists on every device.
    holders.setdefault(key, set()).add(
        device.process_index)  # type: ignore[attr-defined]
  return any(len(p) > 1 for p in holders.values())
