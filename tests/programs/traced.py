"""argv[1] rounds of sync + broadcast + allgather + one recorded event; prints ROUND k each round, then DONE; with argv[2]=='die' process 1 then SIGKILLs itself instead of arriving at the next barrier; with argv[2]=='write' every process then calls write_trace(argv[3])."""

from __future__ import annotations

import os
import signal
import sys
import time

import jax
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
  if len(sys.argv) > 3 and sys.argv[2] == 'write':
    print(f'WROTE {multihost.write_trace(sys.argv[3], timeout=60)}',
          flush=True)
  if len(sys.argv) > 2 and sys.argv[2] == 'die':
    if jax.process_index() == 1:
      os.kill(os.getpid(), signal.SIGKILL)
    multihost.sync_global_devices('after', timeout=60)
  print('DONE', flush=True)


if __name__ == '__main__':
  main()
