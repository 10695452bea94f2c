"""Meets the others at a barrier, prints WHERE <hostname> <coordinator>, then sleeps argv[1] seconds (if given)."""

from __future__ import annotations

import os
import socket
import sys
import time

import multihost
from multihost import env


def main() -> None:
  multihost.initialize()
  multihost.sync_global_devices('placed')
  print('WHERE', socket.gethostname(), os.environ[env.COORDINATOR],
        flush=True)
  if len(sys.argv) > 1:
    time.sleep(float(sys.argv[1]))


if __name__ == '__main__':
  main()
