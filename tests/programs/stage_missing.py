"""Processes of one host where process 1 cannot make a stage (as on a kernel without memfd seals): its links hold none, and broadcasts from every source still return the source's bytes; prints STAGE-MISSING OK.

`stage.Stage.make` answers None on process 1 (before its plane starts):
the source sends process 1 the bytes themselves, and the others the
stage's pieces, in the same call.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import multihost
from multihost._src.runtime import runtime
from multihost._src.transport.tcp import stage

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _links  # noqa: E402  (a sibling module, found by path)


def main() -> None:
  me = int(os.environ['JAX_PROCESS_ID'])
  if me == 1:
    stage.Stage.make = classmethod(lambda cls: None)
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)
  assert _links.wait_until_up('links'), 'the links were not set up'
  count = jax.process_count()
  plane = runtime.current().plane
  assert plane.one_host
  assert (plane.stage is None) == (me == 1), plane.stage
  for size in (1 << 20, (9 << 20) + 12):  # one piece; three, odd
    for source in range(count):
      mine = (np.arange(size // 4, dtype=np.int32) * 7 + me)
      got = multihost.broadcast_one_to_all(mine, is_source=me == source)
      np.testing.assert_array_equal(
          got, np.arange(size // 4, dtype=np.int32) * 7 + source)
  shared = {p: link.shared is not None for p, link in plane.conns.items()}
  assert shared == {p: me != 1 and p != 1 for p in range(count) if p != me}, (
      shared)
  print('STAGE-MISSING OK', flush=True)


if __name__ == '__main__':
  main()
