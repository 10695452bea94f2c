"""Broadcasts and all-gathers 8 B and 2 MiB (a many-leaf tree too); prints each transfer's transport and whether the values came through."""

from __future__ import annotations

import jax
import numpy as np

import multihost
from multihost._src.transport import choice
from multihost._src.transport.tcp import chain


def main() -> None:
  multihost.initialize()
  me = jax.process_index()
  used = []
  for name in ('broadcast', 'allgather'):
    real = getattr(chain, name)

    def spy(*args, real=real, name=name, **kwargs):
      used.append(name)
      return real(*args, **kwargs)
    setattr(chain, name, spy)
  for n in (8, 2 << 20):
    x = np.arange(n // 4, dtype=np.float32) + me
    used.clear()
    got = multihost.broadcast_one_to_all(x)
    ok = np.array_equal(got, np.arange(n // 4, dtype=np.float32))
    print(f'broadcast {n}: {choice.transport(n)} tcp={used} ok={ok}',
          flush=True)
    used.clear()
    got = multihost.process_allgather(x)
    ok = all(np.array_equal(got[p], np.arange(n // 4, dtype=np.float32) + p)
             for p in range(jax.process_count()))
    print(f'allgather {n}: {choice.transport(n)} tcp={used} ok={ok}',
          flush=True)
  # Small and large leaves in one tree: the source sends large ones from
  # their own memory and joins the small ones (`transport.tcp.payload.segments`).
  tree = {'a': np.full(3, me, np.int8), 'b': np.arange(1 << 18, dtype=np.int32) * (me + 1),
          'c': np.float32(me + 7), 'd': np.ones((1 << 17,), np.float32) * me}
  got = multihost.broadcast_one_to_all(tree, is_source=me == 1)
  want = {'a': np.full(3, 1, np.int8), 'b': np.arange(1 << 18, dtype=np.int32) * 2,
          'c': np.float32(8), 'd': np.ones((1 << 17,), np.float32)}
  ok = all(np.array_equal(got[k], want[k]) and got[k].dtype == want[k].dtype
           for k in want)
  obj = multihost.broadcast_object(bytes(range(256)) * 8192)
  ok = ok and obj == bytes(range(256)) * 8192
  print(f'tree ok={ok}', flush=True)


if __name__ == '__main__':
  main()
