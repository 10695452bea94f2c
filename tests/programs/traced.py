"""argv[1] rounds of sync + broadcast + allgather + one recorded event; prints ROUND k each round, then DONE; with argv[2]=='hang' process 1 then stops arriving (sleeps)."""

from __future__ import annotations

import sys
import time

import numpy as np

import multihost


def main() -> None:
  multihost.initialize()
  rounds = int(sys.argv[1])
  for k in range(rounds):
    multihost.sync_global_devices(f'round {k}', timeout=60)
    multihost.broadcast_one_to_all(np.arange(4, dtype=np.int64), timeout=60)
    multihost.process_allgather(np.zeros(2, np.float32), timeout=60)
    start = time.monotonic()
    time.sleep(0.01)
    multihost.record_event('checkpoint save', start, time.monotonic(),
                           step=k)
    print(f'ROUND {k}', flush=True)
  if len(sys.argv) > 2 and sys.argv[2] == 'hang':
    if multihost.lowlevel.process_index() == 1:
      time.sleep(600)  # The test kills it here.
    multihost.sync_global_devices('after', timeout=60)
  print('DONE', flush=True)


if __name__ == '__main__':
  main()
