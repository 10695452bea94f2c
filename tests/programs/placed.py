"""Meets the others at a barrier, prints WHERE <hostname> <coordinator>, then sleeps argv[1] seconds (if given).

With argv[2] 'plain' it neither imports JAX nor meets the others: it prints
only WHERE <hostname>, where the launcher placed it (for tests of the
placement and its cleanup, where a JAX start would only add CPU).
"""

from __future__ import annotations

import os
import socket
import sys
import time


def main() -> None:
  if len(sys.argv) > 2 and sys.argv[2] == 'plain':
    print('WHERE', socket.gethostname(), flush=True)
  else:
    import multihost  # noqa: PLC0415 (imports JAX)
    from multihost import env  # noqa: PLC0415
    multihost.initialize()
    multihost.sync_global_devices('placed')
    print('WHERE', socket.gethostname(), os.environ[env.COORDINATOR],
          flush=True)
  if len(sys.argv) > 1:
    time.sleep(float(sys.argv[1]))


if __name__ == '__main__':
  main()
