"""A broadcast source whose host has a core to spare copies its own result on the plane's copier thread, over the links and through its stage: the results, on every process, with and without; prints COPY-ASIDE OK.

`Plane.spare_cores` is set here by hand (this machine may have as many
cores as processes), once the links are up. `Plane.one_host` is turned
off for the first pass (these processes share a host: their broadcasts
would go through the source's stage, `transport.tcp.shared`) and on for
the second, with payloads of the stage's sizes (one piece, and three
pieces through its two slots).
"""

from __future__ import annotations

import numpy as np

import multihost
from multihost._src.control import links
from multihost._src.runtime import runtime
from multihost._src.transport.tcp import eager
from multihost._src.transport.tcp import shared
from multihost._src.transport.tcp import stage


def main() -> None:
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)
  me = jax.process_index()
  rt = runtime.current()
  while not links.usable(rt):
    multihost.sync_global_devices('links')
  plane = rt.plane
  assert plane.one_host  # (on every process)
  jobs = []  # what this process ran on its copier thread
  run = plane.copier.run
  plane.copier.run = lambda fn: (jobs.append(fn), run(fn))[1]
  passes = {False: (eager.ASIDE_FROM - 4, eager.ASIDE_FROM, 1 << 20, 3 << 20),
            True: (shared.SHARED_FROM, 2 * stage.SLOT_BYTES + 4096)}
  for one_host, sizes in passes.items():
    plane.one_host = one_host
    for spare in (False, True):
      plane.spare_cores = spare
      jobs.clear()
      for size in sizes:
        mine = (np.arange(size // 4, dtype=np.float32) * 3 + size + spare
                if me == 0 else np.zeros(size // 4, np.float32))
        want = np.arange(size // 4, dtype=np.float32) * 3 + size + spare
        for _ in range(3):  # (results come from the pool again)
          got = multihost.broadcast_one_to_all({'a': mine, 'b': np.int8(me)})
          np.testing.assert_array_equal(got['a'], want,
                                        err_msg=f'{size} {one_host}')
          assert got['b'] == 0, got['b']
          if me == 0:
            assert not np.shares_memory(got['a'], mine)
            mine[:4] = -1  # The source's result is its own.
            assert got['a'][0] == want[0]
            mine[:4] = want[:4]
      # Only the source copies aside, and only where a core is spare.
      assert bool(jobs) == (spare and me == 0), (one_host, spare, me, jobs)
  print('COPY-ASIDE OK', flush=True)


if __name__ == '__main__':
  main()
