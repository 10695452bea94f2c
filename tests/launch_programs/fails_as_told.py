"""A controller that fails as its environment says; prints its index, attempt and compilation cache folder.

Its index is $JAX_PROCESS_ID (the launcher) or $SLURM_PROCID (srun), its
attempt $MULTIHOST_RESTART_COUNT. It prints `process I attempt A cache
'DIR' exists True`, DIR being $JAX_COMPILATION_CACHE_DIR. Then process
$FAIL_PROCESS (default 1) exits with $FAIL_STATUS (default 1) after 0.3 s,
on the attempts up to $FAIL_UNTIL_ATTEMPT (default: every attempt); every
other process sleeps $SURVIVOR_SLEEP seconds on such an attempt (default
0.5; 0.5 on an attempt where none fails), ignoring SIGTERM if
$SURVIVOR_IGNORES_SIGTERM is 1 (as one blocked in a collective does), and
exits 0.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from multihost import env as env_lib  # (no JAX import: names load lazily)


def main() -> None:
  index = int(os.environ.get(env_lib.PROCESS_ID) or
              os.environ[env_lib.SLURM_PROCID])
  attempt = int(os.environ.get(env_lib.RESTART_COUNT) or 0)
  cache = os.environ.get(env_lib.COMPILATION_CACHE_DIR)
  # One write: under srun the tasks share one stdout.
  os.write(1, (f'process {index} attempt {attempt} cache {cache!r} exists '
               f'{cache is not None and os.path.isdir(cache)}\n').encode())
  until = os.environ.get('FAIL_UNTIL_ATTEMPT')
  fails = until is None or attempt <= int(until)
  if fails and index == int(os.environ.get('FAIL_PROCESS', '1')):
    time.sleep(0.3)
    sys.exit(int(os.environ.get('FAIL_STATUS', '1')))
  if os.environ.get('SURVIVOR_IGNORES_SIGTERM') == '1':
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
  time.sleep(float(os.environ.get('SURVIVOR_SLEEP', '0.5')) if fails else 0.5)


if __name__ == '__main__':
  main()
