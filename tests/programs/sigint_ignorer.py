"""Prints 'pid <pid>' and sleeps 60 s; process 1 ignores SIGINT."""

from __future__ import annotations

import os
import signal
import time


def main() -> None:
  if os.environ['JAX_PROCESS_ID'] == '1':
    signal.signal(signal.SIGINT, signal.SIG_IGN)
  print('pid', os.getpid(), flush=True)
  time.sleep(60)


if __name__ == '__main__':
  main()
