"""64 MiB `process_allgather` calls in a loop until one raises; process 0 prints `COMPANION <pid>` (-1: none), every process `LOOP`, then `ERROR at <time> <type>: <message>` (see argv[2]).

argv[1]: `threads` starts a Python thread before `multihost.initialize()`
(a fork is unsafe then: process 0's companion is the program form,
`python -m multihost._src.runtime.companion`), `plain` does not. argv[2]:
`raise` re-raises the error (uncaught), `exit` exits with status 3,
`os_exit` leaves with `os._exit(3)` (no exit handlers: as a crash, or a
process that leaves by itself after a peer's loss or a stuck step).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

import multihost
from multihost._src.runtime import runtime


def main() -> None:
  if sys.argv[1] == 'threads':
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)
  me = jax.process_index()
  if me == 0:
    companion = runtime.current().companion
    print(f'COMPANION {-1 if companion is None else companion.pid}',
          flush=True)
  big = np.full(64 << 20, me, np.uint8)
  k = 0
  try:
    while True:
      multihost.process_allgather(big)
      k += 1
      if k == 2:
        print('LOOP', flush=True)
  except Exception as e:
    print(f'ERROR at {time.time():.3f} {type(e).__name__}: {e}', flush=True)
    if sys.argv[2] == 'raise':
      raise
    if sys.argv[2] == 'os_exit':
      os._exit(3)
    sys.exit(3)


if __name__ == '__main__':
  main()
