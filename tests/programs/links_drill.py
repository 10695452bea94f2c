"""The agreement over the TCP links with real controllers: argv MODE SLEEPER.

First calls until every process agrees over the links (prints LINKS), then:
mismatch (process SLEEPER passes another barrier name: ConsistencyError
everywhere); skew (SLEEPER arrives 7.5 s late at a 6 s all-gather, then two
more calls that must complete everywhere). Exits 0 after PASSED.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import multihost
from multihost import _control_links
from multihost import _runtime


def main() -> None:
  mode, sleeper = sys.argv[1], int(sys.argv[2])
  multihost.initialize(heartbeat_timeout=3)
  import jax  # noqa: PLC0415 (after initialize)
  me = jax.process_index()
  for _ in range(50):
    multihost.sync_global_devices('setup')
    if _control_links.usable(_runtime.current()):
      break
    time.sleep(0.02)
  print(f'LINKS {_control_links.usable(_runtime.current())}', flush=True)
  if mode == 'mismatch':
    try:
      multihost.sync_global_devices('odd' if me == sleeper else 'even',
                                    timeout=20)
    except multihost.ConsistencyError as e:
      print(f'RAISED ConsistencyError {e}', flush=True)
    out = multihost.process_allgather(np.int32(me), timeout=20)
    print(f'AFTER ok {out.tolist()}', flush=True)
  if mode == 'skew':
    for i in range(3):
      if i == 0 and me == sleeper:
        time.sleep(7.5)
      start = time.monotonic()
      try:
        out = multihost.process_allgather(np.int32(me), timeout=6)
        print(f'STEP {i} ok {out.tolist()}', flush=True)
      except multihost.CollectiveTimeoutError as e:
        print(f'STEP {i} timeout after={time.monotonic() - start:.2f} '
              f'missing={list(e.missing)} message={e}', flush=True)
  print('PASSED', flush=True)


if __name__ == '__main__':
  main()
