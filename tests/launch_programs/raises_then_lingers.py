"""Process 0 raises at once and lingers at exit for 8 s; process 1 prints, sleeps 3 s and exits 1."""

from __future__ import annotations

import atexit
import os
import sys
import time

from multihost import env as env_lib


def _load() -> None:
  raise ValueError('bad batch')


def main() -> None:
  if os.environ[env_lib.PROCESS_ID] == '0':
    # Runs after the traceback is printed, like an exit handshake that
    # waits for a peer.
    atexit.register(time.sleep, 8)
    try:
      _load()
    except ValueError as e:
      raise RuntimeError('step 3 failed') from e
  print('process 1 loading data', flush=True)
  time.sleep(3)
  sys.exit(1)


if __name__ == '__main__':
  main()
