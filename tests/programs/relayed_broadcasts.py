"""Default-source broadcasts of 1 MiB over TCP links (down the binomial tree), then one whose shape differs on one process, then one with differing timeouts; prints CONGESTION <its TCP links' congestion controls>, STAR <whether the processes agree in a star>, FRAMES <process 0's frames a call>, RELAYED OK.

Where the processes agree in a star (one host with no more cores than
processes), such a broadcast's answers are its payload's frames
(`transport.tcp.tree.Relay`): process 0 sends each of its children in the
tree one frame a call, the payload, and nothing else.
"""

from __future__ import annotations

import numpy as np

import multihost

_N = 1 << 18  # float32: 1 MiB


def _payload(k: int) -> np.ndarray:
  return np.arange(_N, dtype=np.float32) + k


def main() -> None:
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)

  from multihost._src.control import links  # noqa: PLC0415
  from multihost._src.runtime import runtime  # noqa: PLC0415
  me, count = jax.process_index(), jax.process_count()
  rt = runtime.current()
  k = 0
  # The first calls meet through the coordination service while the links
  # are set up; every process switches to them in the same call.
  while not links.usable(rt):
    got = multihost.broadcast_one_to_all(_payload(k) if me == 0 else
                                         np.zeros(_N, np.float32))
    np.testing.assert_array_equal(got, _payload(k))
    k += 1
    assert k < 200, 'the links never came up'
  plane = rt.plane
  before = sum(link.sent for link in plane.conns.values())
  for _ in range(10):
    got = multihost.broadcast_one_to_all(_payload(k) if me == 0 else
                                         np.zeros(_N, np.float32))
    np.testing.assert_array_equal(got, _payload(k))
    k += 1
  sent = sum(link.sent for link in plane.conns.values()) - before
  # A difference at a process below another's children (3 of 5: its
  # parent in the tree is 2): every process names it.
  odd = count - 2
  try:
    multihost.broadcast_one_to_all(
        np.zeros(_N + (1 if me == odd else 0), np.float32), timeout=60)
  except multihost.ConsistencyError as e:
    assert f'processes [{odd}] differ from the rest' in str(e), e
  else:
    raise AssertionError('a differing shape was not refused')
  # Differing timeouts: every process learns the smallest (the answers go
  # down the tree before the payload); the bytes arrive all the same.
  got = multihost.broadcast_one_to_all(
      _payload(k) if me == 0 else np.zeros(_N, np.float32), timeout=60 + me)
  np.testing.assert_array_equal(got, _payload(k))
  got = multihost.broadcast_one_to_all(
      _payload(k + 1) if me == 0 else np.zeros(_N, np.float32))
  np.testing.assert_array_equal(got, _payload(k + 1))
  # Every TCP link's congestion control ($MULTIHOST_TCP_CONGESTION unset:
  # reno where the host's default paces, `tcp.sockets.congestion`).
  import socket  # noqa: PLC0415
  used = sorted({link.sock.getsockopt(socket.IPPROTO_TCP,
                                      socket.TCP_CONGESTION, 16)
                 .split(b'\0', 1)[0].decode()
                 for link in plane.conns.values()})
  print(f'CONGESTION {",".join(used)}', flush=True)
  print(f'STAR {plane.star}', flush=True)
  print(f'FRAMES {sent / 10}', flush=True)
  print('RELAYED OK', flush=True)


if __name__ == '__main__':
  main()
