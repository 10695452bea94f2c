"""Barriers in a loop; process 0 SIGKILLs itself at step 20; the others print RAISED <failed> and exit 3."""

from __future__ import annotations

import os
import signal
import time

import multihost


def main() -> None:
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)
  try:
    for step in range(100000):
      multihost.sync_global_devices('step')
      if step == 20 and jax.process_index() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
      time.sleep(0.01)
  except multihost.ProcessFailureError as e:
    os.write(1, f'RAISED {e.failed}\n'.encode())  # One write.
    raise SystemExit(3) from e


if __name__ == '__main__':
  main()
