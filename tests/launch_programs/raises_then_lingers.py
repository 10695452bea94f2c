"""Process 1 prints a line, then exits 1 after 3 s; process 0 raises 1 s after that line is out, then lingers at exit for 8 s.

$READY_FILE is the file process 1 creates after its line, so process 0
raises while process 1 is running with that line printed.
"""

from __future__ import annotations

import atexit
import os
import pathlib
import sys
import time

from multihost import env as env_lib  # (no JAX import: names load lazily)


def _load() -> None:
  raise ValueError('bad batch')


def main() -> None:
  ready = pathlib.Path(os.environ['READY_FILE'])
  if os.environ[env_lib.PROCESS_ID] == '0':
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
      time.sleep(0.05)
    # The launcher stamps each line when its reader thread reads it: give
    # process 1's line time to be read before this traceback is, or the
    # summary may rightly say process 1 had printed nothing yet.
    time.sleep(1)
    # Runs after the traceback is printed, like an exit handshake that
    # waits for a peer.
    atexit.register(time.sleep, 8)
    try:
      _load()
    except ValueError as e:
      raise RuntimeError('step 3 failed') from e
  print('process 1 loading data', flush=True)
  ready.touch()
  time.sleep(3)
  sys.exit(1)


if __name__ == '__main__':
  main()
