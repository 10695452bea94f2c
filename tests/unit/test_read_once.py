"""Which process reads which leaf in a restore that reads the state once (`read_once.plan`)."""

from __future__ import annotations

import jax
import numpy as np

from recovery._src.checkpoint import read_once

MIB = 1 << 20


def _leaf(nbytes: int) -> np.ndarray:
  return np.zeros(nbytes // 4, np.float32)


def test_small_leaves_are_process_0s_and_large_ones_spread_largest_first():
  tree = {'a': _leaf(8 * MIB), 'b': _leaf(4 * MIB), 'c': _leaf(4 * MIB),
          'd': _leaf(2 * MIB), 'e': _leaf(1024), 'f': np.zeros((), np.int64)}
  readers = {jax.tree_util.keystr(p): r
             for p, r in read_once.plan(tree, 3).items()}
  # e and f (small) to 0; then, largest first, each to the process with
  # the fewest bytes: a (8 MiB) to 1, b to 2, c to 0 (a few bytes so far),
  # d to 2 (4 MiB, where 0 has 4 MiB and 1 KiB).
  assert readers == {"['a']": 1, "['b']": 2, "['c']": 0, "['d']": 2,
                     "['e']": 0, "['f']": 0}


def test_every_process_would_read_a_leaf_when_there_are_enough():
  tree = {str(i): _leaf(2 * MIB) for i in range(8)}
  assert sorted(read_once.plan(tree, 4).values()) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_numpy_or_replicated_leaf_is_whole_on_every_process():
  mesh = jax.make_mesh((jax.device_count(),), ('d',))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  assert read_once.whole_on_every_process(_leaf(16))
  assert read_once.whole_on_every_process(
      jax.ShapeDtypeStruct((4,), np.float32, sharding=rep))
