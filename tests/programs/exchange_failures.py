"""Ring exchanges of 4 MiB where process 2 fails (argv[1]: 'dies': SIGKILLs itself at call 20; 'late': never calls).

The others print RAISED <failed> and exit 3 on ProcessFailureError, or
TIMEOUT <message> and exit 4 on CollectiveTimeoutError.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import multihost


def main() -> None:
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)
  me, count = jax.process_index(), jax.process_count()
  mode = sys.argv[1]
  if mode == 'late' and me == 2:
    time.sleep(30)
    return
  data = np.full(4 << 20, me, np.uint8)
  # A dead peer is named by the failure detection (heartbeat 10 s + 2 s), so
  # its calls wait longer than that; a late one is named by the timeout.
  timeout = 5 if mode == 'late' else 60
  try:
    for call in range(1000):
      if mode == 'dies' and me == 2 and call == 20:
        os.kill(os.getpid(), signal.SIGKILL)
      got = multihost.exchange({(me + 1) % count: data},
                               recv_from=[(me - 1) % count], timeout=timeout)
      assert int(got[(me - 1) % count][-1]) == (me - 1) % count
  except multihost.ProcessFailureError as e:
    os.write(1, f'RAISED {e.failed}\n'.encode())
    raise SystemExit(3) from e
  except multihost.CollectiveTimeoutError as e:
    os.write(1, f'TIMEOUT {e}\n'.encode())
    raise SystemExit(4) from e


if __name__ == '__main__':
  main()
