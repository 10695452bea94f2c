"""The agreement over the TCP links with real controllers: argv MODE[,MODE...] SLEEPER[,SLEEPER...].

Per MODE (and its SLEEPER), in order: prints MODE <mode>, calls until every
process agrees over the links (prints LINKS), then: mismatch (process
SLEEPER passes another barrier name: ConsistencyError everywhere); skew
(SLEEPER arrives 7.5 s late at a 6 s all-gather, then two more calls that
must complete everywhere). Exits 0 after PASSED.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import multihost
from multihost import _control_links
from multihost import _runtime


def drill(mode: str, sleeper: int, me: int) -> None:
  """One MODE, once the processes agree over the links."""
  print(f'MODE {mode}', flush=True)
  # Until the links are set up (every process switches in the same call).
  # The bound is a number of calls, the same on every process, so all stop
  # calling together; at 20 ms apart it outlasts the setup time (30 s).
  for _ in range(int(_control_links.SETUP_S / 0.02)):
    multihost.sync_global_devices(f'setup {mode}')
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


def main() -> None:
  modes = sys.argv[1].split(',')
  sleepers = [int(s) for s in sys.argv[2].split(',')]
  multihost.initialize(heartbeat_timeout=3)
  import jax  # noqa: PLC0415 (after initialize)
  me = jax.process_index()
  for mode, sleeper in zip(modes, sleepers, strict=True):
    drill(mode, sleeper, me)
  print('PASSED', flush=True)


if __name__ == '__main__':
  main()
