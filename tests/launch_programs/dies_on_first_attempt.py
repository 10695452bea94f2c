"""A controller that SIGKILLs itself on attempt 0 if it is process 1; prints its index and attempt."""

from __future__ import annotations

import os
import signal
import time

from multihost import env as env_lib  # (no JAX import: names load lazily)


def main() -> None:
  index = int(os.environ[env_lib.PROCESS_ID])
  attempt = int(os.environ[env_lib.RESTART_COUNT])
  print(f'process {index} attempt {attempt}', flush=True)
  if attempt == 0 and index == 1:
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)
  time.sleep(0.5)


if __name__ == '__main__':
  main()
