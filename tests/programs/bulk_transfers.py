"""Broadcasts from every source, all-gathers a tree and objects of 3 MiB-scale payloads; prints TRANSPORT OK.

Over TCP, among processes of one host with local links, the broadcasts
go through the source's stage (`transport.tcp.shared`): the program checks
that no lane opened and every link holds its peer's stage. Otherwise the
broadcasts of 4 MiB and more go in stripes over $MULTIHOST_TCP_LANES links
per pair (default 2): the program checks the links each lane opened. Both
check an odd-sized payload's bytes.
"""

from __future__ import annotations

import numpy as np

import multihost
from multihost import lowlevel


def main() -> None:
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)
  me, count = jax.process_index(), jax.process_count()
  big = np.arange(3 << 18, dtype=np.float32) * (me + 1)  # 3 MiB
  for source in range(count):
    got = multihost.broadcast_one_to_all(big, is_source=me == source)
    np.testing.assert_array_equal(got, big / (me + 1) * (source + 1))
    assert not np.shares_memory(got, big)
  # Back to back from one source, each call's bytes different: through the
  # stage, the next call must not overwrite a piece a receiver still copies.
  for k in range(8):
    mine = (np.arange((9 << 20) + 5) % 253).astype(np.uint8) + k
    got = multihost.broadcast_one_to_all(mine if me == 0 else mine * 0)
    np.testing.assert_array_equal(got, mine)
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
  # An odd size over the lanes (stripes end mid-leaf and mid-page), from
  # the last process, and an object broadcast (no result on the source).
  odd = {'x': (np.arange((5 << 20) + 3) % 251).astype(np.uint8) + me,
         'y': np.arange(3, dtype=np.float64) * me}
  got = multihost.broadcast_one_to_all(odd, is_source=me == count - 1)
  np.testing.assert_array_equal(got['x'], odd['x'] - me + count - 1)
  np.testing.assert_array_equal(got['y'], np.arange(3) * (count - 1.0))
  blob = multihost.broadcast_object(bytes(range(256)) * (24 << 10)
                                    if me == 0 else None)
  assert blob == bytes(range(256)) * (24 << 10)
  from multihost._src.runtime import runtime
  from multihost._src.runtime import settings
  plane = runtime.current().plane
  if lowlevel.tcp_transport_enabled() and plane.one_host:
    # Every broadcast went through the source's stage: no lane opened, and
    # every link to a peer on this host holds the peer's stage.
    assert not any(isinstance(k, tuple) for k in plane.conns), plane.conns
    assert all(link.shared is not None for link in plane.conns.values())
    print(f'STAGED {len(plane.conns)} links', flush=True)
  elif lowlevel.tcp_transport_enabled():
    lanes = settings.tcp_lanes()
    # Every lane past the first has a link to each chain neighbour.
    opened = {k for k in plane.conns if isinstance(k, tuple)}
    want_lanes = {((me + d) % count, lane) for d in (1, -1)
                  for lane in range(1, lanes)}
    assert opened == want_lanes, (opened, want_lanes)
    print(f'LANES {lanes}', flush=True)
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
