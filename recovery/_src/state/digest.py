"""Host-side global values of a state tree, and its digests by leaf path."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np

import multihost
from recovery._src.state import leaves
from recovery._src.state.leaves import path_name as path_name
from recovery._src.state.state import TransitionState

PyTree = Any

# The digest algorithm a checkpoint names (its meta item's
# `digest_algorithm`), so that a change of algorithm is detected instead of
# being reported as corruption, and the `multihost.leaf_digests` version it
# is. A save records DIGEST_ALGORITHM; a restore checks a checkpoint with the
# algorithm it names. v1 digested 64-bit NumPy leaves (the cursor, epoch and
# step among them) as their 32-bit casts when jax_enable_x64 was off; v2
# digests every bit of every leaf.
ALGORITHMS = {'multihost-leaf-digests-v1': 1, 'multihost-leaf-digests-v2': 2}
DIGEST_ALGORITHM = 'multihost-leaf-digests-v2'


def host_value(x: Any) -> np.ndarray:
  """Returns the global value of one leaf as a NumPy array on this host.

  Typed PRNG keys become their key data; Python scalars 0-d arrays. A
  replicated `jax.Array` is read
  from a local shard; an array sharded across processes is gathered.

  Collective (only for leaves sharded across processes): every process must
  call this, in the same order.
  """
  if isinstance(x, jax.Array):
    if leaves.is_key(x):
      x = jax.random.key_data(x)
    if x.is_fully_addressable:
      return np.asarray(x)
    if x.sharding.is_fully_replicated:
      return np.asarray(x.addressable_shards[0].data)
    return np.asarray(multihost.process_allgather(x, tiled=True))
  return np.asarray(x)


def host_tree(tree: PyTree) -> PyTree:
  """`host_value` of every leaf.

  Collective (when some leaf is sharded across processes): every process
  must call this, in the same order.
  """
  return jax.tree.map(host_value, tree)


def checkpoint_leaf_digests(tree: PyTree, *, algorithm: str | None = None
                            ) -> dict[str, str]:
  """Maps each leaf's path ('user/weights') to a digest of its global value.

  Digests are of the tree's checkpointed form (`recovery._src.state.leaves.storable`:
  Python scalars as 0-d NumPy arrays, keys as their key data, None and empty
  subtrees absent), by `multihost.leaf_digests` (dtype, shape and every bit
  of the items in that dtype, so the same for the same global content on any
  mesh or number of processes); keys are '/'-joined paths, as stored in a
  checkpoint's metadata. `algorithm` is one of `ALGORITHMS`: by default
  DIGEST_ALGORITHM, the one a save records; another to check a checkpoint
  that names it.

  Collective (when some leaf is sharded across processes): every process
  must call this, in the same order. Such a leaf is not gathered: each
  process digests its own shards (see `multihost.leaf_digests`).
  """
  stored = leaves.storable(tree)
  names = [path_name(path)
           for path, _ in jax.tree_util.tree_flatten_with_path(stored)[0]]
  digests = multihost.leaf_digests(
      stored, version=ALGORITHMS[algorithm or DIGEST_ALGORITHM])
  return dict(zip(names, digests.values(), strict=True))


def checkpoint_digest(tree: TransitionState | PyTree) -> str:
  """The digest a checkpoint of `tree` stores (its `meta` item's `digest`).

  64 hex characters: SHA-256 of `checkpoint_leaf_digests(tree)`, so of the
  tree's checkpointed form. It is the same for a saved state and for the
  state restored from it, whose leaf kinds may differ (a Python int and the
  0-d array it is stored as, a host-local array and the global one), and on
  any mesh. `multihost.tree_digest` (32 hex) is another digest: of a pytree
  as it is, its treedef included (a dataclass and the dict it is stored as
  differ), for comparing trees across processes; the two never compare.

  Collective (when some leaf is sharded across processes): every process
  must call this, in the same order.
  """
  if isinstance(tree, TransitionState):
    tree = tree.to_tree()
  return combine(checkpoint_leaf_digests(tree))


def combine(digests: dict[str, str], *, algorithm: str | None = None) -> str:
  """One hex digest of a {leaf path: leaf digest} map (of `algorithm`'s leaf digests; by default DIGEST_ALGORITHM's)."""
  h = hashlib.sha256((algorithm or DIGEST_ALGORITHM).encode())
  for name, digest in sorted(digests.items()):
    h.update(f'{name}={digest};'.encode())
  return h.hexdigest()
