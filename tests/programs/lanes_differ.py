"""Process 1 sets $MULTIHOST_TCP_LANES=3, the others 2; an 8 MiB broadcast must raise ConsistencyError naming the variable, at once, on every process."""

from __future__ import annotations

import os
import time

import numpy as np

import multihost


def main() -> None:
  index = int(os.environ['JAX_PROCESS_ID'])
  os.environ['MULTIHOST_TCP_LANES'] = '3' if index == 1 else '2'
  multihost.initialize()
  start = time.monotonic()
  try:
    multihost.broadcast_one_to_all(np.zeros(8 << 20, np.uint8), timeout=30)
  except multihost.ConsistencyError as e:
    print(f'CONSISTENCY after {time.monotonic() - start:.1f} s: {e}',
          flush=True)
  else:
    print('NO ERROR', flush=True)


if __name__ == '__main__':
  main()
