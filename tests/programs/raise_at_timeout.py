"""Process 1 sleeps 40 s in user code; process 0 raises from a 5 s barrier, uncaught.

The shape of a data loader stuck on one process while the other times out.
Prints `RAISING at=<time.time()>` on process 0 just before the call.
"""

from __future__ import annotations

import time

import multihost


def main() -> None:
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)

  multihost.sync_global_devices('start', timeout=60)
  if jax.process_index() == 1:
    print('SLEEPING', flush=True)
    time.sleep(40)
    return
  print(f'RAISING at={time.time():.3f}', flush=True)
  multihost.sync_global_devices('x', timeout=5)  # Raises: process 1 sleeps.


if __name__ == '__main__':
  main()
