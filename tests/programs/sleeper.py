"""Prints `PID <pid>` and sleeps (argv[1] seconds, default 1000); for launchers to stop."""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
  print('PID', os.getpid(), flush=True)
  time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 1000)


if __name__ == '__main__':
  main()
