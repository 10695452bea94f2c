"""Point-to-point exchanges in several patterns, checked byte for byte; prints EXCHANGE OK.

Each process checks that it received exactly what was sent to it, from
exactly the processes that sent to it, and nothing else; a mismatched
pattern raises ConsistencyError on every process; the links are clean
after (an all-gather over them passes). Each process prints its bytes
received per peer across one exchange of
a large payload from process 0 to process 1 alone: with the links over
TCP ($MULTIHOST_LOCAL_LINKS=0), the kernel's count of bytes received on
each link (TCP_INFO), so a byte that reaches a process that did not ask
for it shows in that process's count.
"""

from __future__ import annotations

import os
import socket
import struct

import numpy as np

import multihost
from multihost import env


def _payload(src: int, dst: int, n: int) -> np.ndarray:
  """What `src` sends `dst`: n bytes that name both."""
  return ((np.arange(n, dtype=np.int64) * (src + 3) + dst) % 251).astype(
      np.uint8)


# struct tcp_info: tcpi_bytes_received, a u64 at byte 128 (Linux 4.1+).
_BYTES_RECEIVED = struct.Struct('<Q')
_AT = 128


def received_by_peer() -> dict[int, int]:
  """Bytes the kernel received on each TCP link of this process's plane, by peer (lanes summed)."""
  from multihost._src.runtime import runtime  # noqa: PLC0415
  out: dict[int, int] = {}
  for key, link in list(runtime.current().plane.conns.items()):
    peer = key if isinstance(key, int) else key[0]
    if link.sock.family not in (socket.AF_INET, socket.AF_INET6):
      continue
    info = link.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    out[peer] = out.get(peer, 0) + _BYTES_RECEIVED.unpack_from(info, _AT)[0]
  return out


def main() -> None:
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)
  me, count = jax.process_index(), jax.process_count()
  limit = int(os.environ.get(env.MAX_OBJECT_BYTES, 1 << 30))
  # 1. A ring, objects holding arrays well over the object limit.
  big = 3 * limit + 5
  nxt, prev = (me + 1) % count, (me - 1) % count
  # (A jax.Array comes back as a NumPy array; a strided one, contiguous.)
  got = multihost.exchange(
      {nxt: {'from': me, 'data': _payload(me, nxt, big), 'tag': b'x' * 7,
             'jax': jax.numpy.full(big // 4, me, jax.numpy.float32),
             'strided': _payload(me, nxt, 2 * big)[::2]}},
      recv_from=[prev])
  assert sorted(got) == [prev], got.keys()
  mine = got[prev]
  assert mine['from'] == prev and mine['tag'] == b'x' * 7
  np.testing.assert_array_equal(mine['data'], _payload(prev, me, big))
  assert type(mine['jax']) is np.ndarray and mine['jax'].dtype == np.float32
  np.testing.assert_array_equal(mine['jax'], np.full(big // 4, prev))
  np.testing.assert_array_equal(mine['strided'],
                                _payload(prev, me, 2 * big)[::2])
  # 2. One pair only: process 0 to process 1; the others get nothing,
  # and no byte of it reaches them (the kernel's counts, over TCP links).
  sends = {1: _payload(0, 1, 5 << 20)} if me == 0 else {}
  before = received_by_peer()
  got = multihost.exchange(sends)
  multihost.sync_global_devices('counted')  # (Every send is out.)
  after = received_by_peer()
  grew = {p: n - before.get(p, 0) for p, n in after.items()}
  print(f'process {me}: RECEIVED BY PEER {sorted(grew.items())}', flush=True)
  if after:  # Links over TCP: what the kernel counted.
    for peer, n in grew.items():
      if (peer, me) == (0, 1):
        assert n >= 5 << 20, (peer, n)
      else:  # The call's agreement and the barrier: a few frames.
        assert n < 64 << 10, f'{n} bytes from process {peer}'
    print(f'process {me}: COUNTED', flush=True)
  if me == 1:
    assert sorted(got) == [0]
    np.testing.assert_array_equal(got[0], _payload(0, 1, 5 << 20))
  else:
    assert got == {}, got.keys()
  # 3. Every process to every other one (itself included), sizes by pair.
  sends = {d: _payload(me, d, 1000 * (me + 1) + 37 * d) for d in range(count)}
  got = multihost.exchange(sends, recv_from=range(count))
  assert sorted(got) == list(range(count))
  assert got[me] is sends[me]
  for p in range(count):
    np.testing.assert_array_equal(got[p], _payload(p, me, 1000 * (p + 1)
                                                   + 37 * me))
  # 4. A mismatch: process 0 sends to the last process, which does not
  # expect it. Every process raises, naming the pair.
  last = count - 1
  try:
    multihost.exchange({last: 1} if me == 0 else {},
                       recv_from=[] if me == last else None)
  except multihost.ConsistencyError as e:
    assert f'process 0 sends to process {last}, which does not expect' in str(
        e), e
  else:
    raise AssertionError('a mismatched pattern did not raise')
  # 5. The links hold nothing left over: an all-gather over them passes.
  ids = multihost.process_allgather(np.int32(me))
  assert ids.tolist() == list(range(count))
  print(f'process {me}: EXCHANGE OK', flush=True)


if __name__ == '__main__':
  main()
