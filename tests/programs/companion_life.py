"""Barriers in a loop; process 0 prints `COMPANION <pid> <forked>` (pid -1: none), then every process `LOOPING`.

argv[1]: `exit` (all leave after step 20, DONE), `kill0` (process 0
SIGKILLs itself at step 20; the others print `RAISED <failed>` and exit 3)
or `loop` (until killed).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import multihost
from multihost._src.runtime import runtime


def main() -> None:
  mode = sys.argv[1]
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)
  me = jax.process_index()
  if me == 0:
    companion = runtime.current().companion
    pid, forked = ((companion.pid, companion.forked) if companion is not None
                   else (-1, False))
    print(f'COMPANION {pid} {forked}', flush=True)
  print('LOOPING', flush=True)
  try:
    for step in range(100000):
      multihost.sync_global_devices('step')
      if step == 20 and mode == 'exit':
        break
      if step == 20 and mode == 'kill0' and me == 0:
        os.kill(os.getpid(), signal.SIGKILL)
      time.sleep(0.01)
  except multihost.ProcessFailureError as e:
    print(f'RAISED {e.failed} at {time.time():.3f}', flush=True)
    raise SystemExit(3) from e
  print('DONE', flush=True)


if __name__ == '__main__':
  main()
