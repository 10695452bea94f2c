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
