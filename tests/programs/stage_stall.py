"""Processes of one host; process 1 freezes (SIGSTOP to itself) in a broadcast through process 0's stage, after copying the first piece and before releasing it; the others print RAISED <type> missing=<list> after=<seconds>: <message>.

The freeze is placed by wrapping, on process 1 only, the socket send with
which `tcp.shared` releases a slot: so it lands inside the transfer, after
the call agreed, every time. Process 0, the source, waits for that release
before its third piece (argv[1]: the call's timeout in seconds); process 2
waits for the third piece, with argv[2] seconds more: process 0 gives up
first and closes its links, and process 2 must still raise in its own time.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import types

import numpy as np

import multihost
from multihost._src.transport.tcp import shared
from multihost._src.transport.tcp import sockets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _links  # noqa: E402  (a sibling module, found by path)


def _freezing_send_all(sock, data, watch):
  os.kill(os.getpid(), signal.SIGSTOP)
  sockets.send_all(sock, data, watch)


def main() -> None:
  timeout, later = float(sys.argv[1]), float(sys.argv[2])
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)
  assert _links.wait_until_up('links'), 'the links were not set up'
  me = jax.process_index()
  size = (9 << 20) + 12  # three pieces through the stage's two slots
  data = np.full(size, me, np.uint8)
  got = multihost.broadcast_one_to_all(data, timeout=120)  # (the first call)
  assert int(got[0]) == 0 and int(got[-1]) == 0
  print('READY', flush=True)
  if me == 1:
    shared.sockets = types.SimpleNamespace(send_all=_freezing_send_all)
  if me == 2:
    timeout += later
  start = time.monotonic()
  try:
    multihost.broadcast_one_to_all(data, timeout=timeout)
  except multihost.CollectiveTimeoutError as e:
    print(f'RAISED {type(e).__name__} missing={list(e.missing)} '
          f'after={time.monotonic() - start:.2f}: {e}', flush=True)
    sys.exit(4)
  except Exception as e:  # noqa: BLE001
    print(f'RAISED {type(e).__name__}: {e}', flush=True)
    sys.exit(3)
  print('COMPLETED', flush=True)


if __name__ == '__main__':
  main()
