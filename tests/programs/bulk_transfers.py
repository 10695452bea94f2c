"""Broadcasts from every source, all-gathers a tree and objects of 3 MiB-scale payloads; prints TRANSPORT OK."""

from __future__ import annotations

import numpy as np

import multihost


def main() -> None:
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)
  me, count = jax.process_index(), jax.process_count()
  big = np.arange(3 << 18, dtype=np.float32) * (me + 1)  # 3 MiB
  for source in range(count):
    got = multihost.broadcast_one_to_all(big, is_source=me == source)
    np.testing.assert_array_equal(got, big / (me + 1) * (source + 1))
    assert not np.shares_memory(got, big)
  # A tree of large and small leaves: the source's own result is a copy
  # (equal, sharing no memory with the leaves, unchanged when they change).
  tree = {'big': np.arange(9 << 18, dtype=np.float32) + me,  # 9 MiB
          'mid': np.arange(25_000, dtype=np.int32) - me,  # ~100 KiB
          'small': np.arange(7, dtype=np.int16) * (me + 2),
          'tiny': np.array(me + 5, np.uint8)}
  expected = {k: np.array(v, copy=True) for k, v in tree.items()}
  got = multihost.broadcast_one_to_all(tree, is_source=me == 1)
  source = {'big': np.arange(9 << 18, dtype=np.float32) + 1,
            'mid': np.arange(25_000, dtype=np.int32) - 1,
            'small': np.arange(7, dtype=np.int16) * 3, 'tiny': np.uint8(6)}
  for k, v in source.items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)
  if me == 1:
    for k, leaf in tree.items():
      assert not np.shares_memory(got[k], leaf), k
      leaf[...] = 0
    for k, v in expected.items():
      np.testing.assert_array_equal(got[k], v, err_msg=k)
  stacked = multihost.process_allgather({'a': big, 'b': np.int32(me)})
  for p in range(count):
    np.testing.assert_array_equal(stacked['a'][p], big / (me + 1) * (p + 1))
  assert stacked['b'].tolist() == list(range(count))
  sizes = [len(x) for x in
           multihost.allgather_object(b'z' * (200_000 * (me + 1)))]
  assert sizes == [200_000 * (p + 1) for p in range(count)], sizes
  print('TRANSPORT OK', flush=True)


if __name__ == '__main__':
  main()
