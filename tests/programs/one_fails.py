"""Process 1 fails after 0.3 s (argv[1]: 'exit3' or 'segv'); the others ignore SIGTERM and wait 60 s."""

from __future__ import annotations

import os
import signal
import sys
import time


def main() -> None:
  if os.environ['JAX_PROCESS_ID'] == '1':
    time.sleep(0.3)
    if sys.argv[1] == 'exit3':
      sys.exit(3)
    os.kill(os.getpid(), signal.SIGSEGV)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)  # Forces the SIGKILL.
  print('waiting', flush=True)
  time.sleep(60)


if __name__ == '__main__':
  main()
