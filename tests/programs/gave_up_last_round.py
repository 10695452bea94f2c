"""A process gives a call up on its last agreement round while the others complete it: every process must raise.

Process 1 (timeout 1.5 s) waits in its last round for the frame of process
H = (1 - 2^(rounds - 1)) mod P, which holds its first agreement frame 2.5 s
(its send sleeps); every other process has a 30 s timeout. Process 1 has
sent every frame the others need, so they complete the rounds once H sends,
after process 1 gave up: the call's outcome record (`control.rounds`) makes
them raise too. Per collective, prints `CALL <op> <i> ok` or `CALL <op> <i>
<error type> <message>` for the call with the held frame (i = 0) and two
after it (i = 1, 2), which must return everywhere. Exits 0 after PASSED.
"""

from __future__ import annotations

import math
import os
import sys
import time

import numpy as np

import multihost
from multihost._src.transport.tcp import sockets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _links  # noqa: E402  (a sibling module, found by path)


def _hold_first_send(seconds: float) -> None:
  """Makes this process's next send over the links wait `seconds` first (once)."""
  real = sockets.send_all
  held = []

  def holding(conn, view, deadline):
    if not held:
      held.append(True)
      time.sleep(seconds)
    return real(conn, view, deadline)

  sockets.send_all = holding


def main() -> None:
  multihost.initialize(heartbeat_timeout_seconds=5)
  import jax  # noqa: PLC0415 (after initialize)
  me, count = jax.process_index(), jax.process_count()
  rounds = math.ceil(math.log2(count))
  holder = (1 - 2 ** (rounds - 1)) % count
  up = _links.wait_until_up('setup')
  print(f'LINKS {up}', flush=True)
  x = np.arange(1024, dtype=np.float32) + me
  ops = {
      'sync_global_devices': lambda t: multihost.sync_global_devices(
          'held', timeout=t),
      'broadcast_one_to_all': lambda t: np.testing.assert_array_equal(
          multihost.broadcast_one_to_all(x, timeout=t),
          np.arange(1024, dtype=np.float32)),
      'process_allgather': lambda t: multihost.process_allgather(
          x, timeout=t),
  }
  for name, op in ops.items():
    multihost.sync_global_devices(f'start {name}', timeout=30)
    for i in range(3):
      timeout = 30.0
      if i == 0:
        timeout = 1.5 if me == 1 else 30.0
        if me == holder:
          _hold_first_send(2.5)
      try:
        op(timeout)
        print(f'CALL {name} {i} ok', flush=True)
      except multihost.MultihostError as e:
        print(f'CALL {name} {i} {type(e).__name__} {e}', flush=True)
      sockets.send_all = _REAL_SEND
    multihost.sync_global_devices(f'end {name}', timeout=60)
  print('PASSED', flush=True)


_REAL_SEND = sockets.send_all

if __name__ == '__main__':
  main()
