"""On attempt 0, process 1 raises a chain of exceptions after its first line while process 0 waits (and says so when it is stopped); on later attempts both print a line and exit 0, unless $RAISE_EVERY_ATTEMPT is 1.

Each prints `process I attempt A` first.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from multihost import env as env_lib  # (no JAX import: names load lazily)


def _load() -> None:
  raise ValueError('bad batch 7')


def _stopped(*_) -> None:
  print('process 0 got SIGTERM while waiting', flush=True)
  sys.exit(1)


def main() -> None:
  index = int(os.environ[env_lib.PROCESS_ID])
  attempt = int(os.environ[env_lib.RESTART_COUNT])
  print(f'process {index} attempt {attempt}', flush=True)
  if attempt > 0 and os.environ.get('RAISE_EVERY_ATTEMPT') != '1':
    return
  if index == 1:
    time.sleep(0.5)
    try:
      _load()
    except ValueError as e:
      raise RuntimeError('step 3 failed') from e
  signal.signal(signal.SIGTERM, _stopped)
  time.sleep(60)


if __name__ == '__main__':
  main()
