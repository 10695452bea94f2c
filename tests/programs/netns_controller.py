"""One controller per simulated host: collectives over TCP and the device transport, a jitted gloo sum; prints RESULT <json>."""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np

import multihost
from multihost import env as mh_env
from multihost._src.runtime import runtime

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _links  # noqa: E402  (a sibling module, found by path)


def listening() -> list[str]:
  out = []
  for name in ('/proc/net/tcp', '/proc/net/tcp6'):
    with open(name) as f:
      for line in f.read().splitlines()[1:]:
        fields = line.split()
        if fields[3] == '0A':  # LISTEN
          out.append(fields[1])
  return out


def main() -> None:
  multihost.initialize()
  me, n = jax.process_index(), jax.process_count()
  report = {'me': me, 'listening': listening() if me == 0 else []}
  multihost.sync_global_devices('start')

  small = multihost.process_allgather(np.array([me, 10 * me]))
  assert small.tolist() == [[i, 10 * i] for i in range(n)], small
  big_len = (64 << 20) // 4
  t = time.monotonic()
  big = multihost.process_allgather(np.full(big_len, me, np.float32))
  report['allgather_64MiB_s'] = time.monotonic() - t
  assert big.shape == (n, big_len)
  for i in range(n):
    assert (big[i] == i).all(), i
  got = multihost.broadcast_one_to_all(np.arange(5) + 100 * me)
  assert got.tolist() == list(range(5)), got
  # Once the calls agree over the links (a count of calls every process
  # shares, so all stop together): 16 MiB broadcasts in two stripes, one
  # per lane, down the chain of hosts; from process 0 its first stripe goes
  # out with its agreement frame.
  up = _links.wait_until_up('links')
  report['links'] = up
  want = np.arange(4 << 20, dtype=np.float32)
  for source in (0, n - 1):
    t = time.monotonic()
    got = multihost.broadcast_one_to_all(want + me - source,
                                         is_source=me == source)
    report[f'broadcast_16MiB_from_{source}_s'] = time.monotonic() - t
    np.testing.assert_array_equal(got, want)
  report['lane_links'] = sorted(
      str(k) for k in runtime.current().plane.conns if isinstance(k, tuple))
  # Every link crosses hosts here: TCP, never a local socket.
  report['families'] = sorted({
      link.sock.family.name for link in runtime.current().plane.conns.values()})

  # A device collective: a jitted sum over one device per process (gloo).
  mesh = jax.make_mesh((n,), ('p',), devices=jax.devices())
  sharding = jax.NamedSharding(mesh, jax.P('p'))
  x = jax.make_array_from_process_local_data(
      sharding, np.array([me + 1.0], np.float32), (n,))
  total = jax.jit(lambda a: a.sum(),
                  out_shardings=jax.NamedSharding(mesh, jax.P()))(x)
  assert float(total.addressable_data(0)) == n * (n + 1) / 2, total

  # The same collectives over the device transport.
  os.environ[mh_env.TRANSPORT] = 'device'
  small = multihost.process_allgather(np.array([me, 10 * me]))
  assert small.tolist() == [[i, 10 * i] for i in range(n)], small
  got = multihost.broadcast_one_to_all(np.arange(5) + 100 * me)
  assert got.tolist() == list(range(5)), got
  multihost.sync_global_devices('end')
  print('RESULT ' + json.dumps(report), flush=True)


if __name__ == '__main__':
  main()
