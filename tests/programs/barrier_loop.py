"""Barriers in a loop for argv[1] seconds (agreed by broadcast); prints LOOP, then DONE with the largest gap, or ERROR and exits 3."""

from __future__ import annotations

import sys
import time

import numpy as np

import multihost


def main() -> None:
  multihost.initialize()
  multihost.sync_global_devices('start')
  print('LOOP', flush=True)
  t0 = last = time.monotonic()
  gap = 0.0
  k = 0
  try:
    while True:
      multihost.sync_global_devices(f's{k}', timeout=60)
      stop = multihost.broadcast_one_to_all(
          np.array(time.monotonic() - t0 > float(sys.argv[1])))
      gap, last, k = max(gap, time.monotonic() - last), time.monotonic(), k + 1
      if bool(stop):
        break
      time.sleep(0.05)
  except Exception as e:  # noqa: BLE001
    print(f'ERROR {type(e).__name__}: {e}', flush=True)
    sys.exit(3)
  print(f'DONE iterations={k} max_gap={gap:.2f}', flush=True)


if __name__ == '__main__':
  main()
