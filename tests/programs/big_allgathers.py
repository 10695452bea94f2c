"""All-gathers 256 MiB per process in a loop (argv[1]: each call's timeout after the first two); prints LOOP, then ERROR <type>: <message> and exits 3."""

from __future__ import annotations

import sys

import numpy as np

import multihost


def main() -> None:
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)
  big = np.full(256 << 20, jax.process_index(), np.uint8)
  k = 0
  try:
    while True:
      # The first calls map the results' memory and grow the links' socket
      # buffers: they get a long timeout, so only a frozen peer times out.
      timeout = float(sys.argv[1]) if k >= 2 else 120.0
      multihost.process_allgather(big, timeout=timeout)
      k += 1
      if k == 2:
        print('LOOP', flush=True)
  except Exception as e:  # noqa: BLE001
    print(f'ERROR {type(e).__name__}: {e}', flush=True)
    sys.exit(3)


if __name__ == '__main__':
  main()
