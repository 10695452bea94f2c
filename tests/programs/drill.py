"""Loops one collective until a peer dies; prints what it raised.

Usage: drill.py MODE SIZE SLEEPER, with DRILL_HB the heartbeat timeout in
seconds (empty: the defaults). MODE: barrier, allgather, broadcast (loops);
late (SLEEPER arrives 6 s late at a 2 s barrier); skew (SLEEPER arrives
7.5 s late at a 6 s all-gather, then two more); idle (a peer dies while
this process computes). SIZE: 'big' (16 MiB per process; the test picks
the transport) or 'small' (64 bytes). Exits 3 on ProcessFailureError, 4 on CollectiveTimeoutError.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import multihost
from multihost import lowlevel


def main() -> None:
  mode, size, sleeper = sys.argv[1], sys.argv[2], int(sys.argv[3])
  if os.environ['DRILL_HB']:
    multihost.initialize(heartbeat_timeout_seconds=float(os.environ['DRILL_HB']))
  else:  # The defaults.
    multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)

  print(f'BOUND {lowlevel.failure_detection_bound():g}', flush=True)
  print('TRANSPORT', 'tcp' if lowlevel.tcp_transport_enabled() else 'device',
        flush=True)

  me = jax.process_index()
  # 'big': 16 MiB per process (over TCP, a broadcast in stripes over the
  # lanes; or by a gloo device collective); 'tree': 1 MiB (over TCP links,
  # a broadcast down the binomial tree; where the processes agree in a
  # star, its payload's frames are the answers); 'small': 64 bytes,
  # carried in the agreement.
  n = {'big': 4 << 20, 'tree': 1 << 18}.get(size, 16)
  data = np.full((n,), me, np.float32)
  print('READY', flush=True)
  step = 0
  try:
    if mode == 'late':
      if me == sleeper:
        time.sleep(6)
      multihost.sync_global_devices('late', timeout=2)
      print('PASSED', flush=True)
    if mode == 'skew':  # SLEEPER arrives 7.5 s late at a 6 s collective
      # (later than the others give up: at 6 s, or up to a second after).
      for i in range(3):
        if i == 0 and me == sleeper:
          time.sleep(7.5)
        start = time.monotonic()
        try:
          out = multihost.process_allgather(np.int32(me), timeout=6)
          print(f'STEP {i} ok {out.tolist()}', flush=True)
        except multihost.CollectiveTimeoutError as e:
          print(f'STEP {i} timeout after={time.monotonic() - start:.2f} '
                f'missing={list(e.missing)}', flush=True)
      print('PASSED', flush=True)
    if mode == 'idle':  # The peer dies while this process computes.
      time.sleep(5)
      print(f'WOKE at={time.time():.3f}', flush=True)
      multihost.sync_global_devices('after the failure')
    while mode not in ('late', 'idle', 'skew'):
      if mode == 'barrier':
        if me == sleeper and step == 3:
          print('SLEEPING', flush=True)
          time.sleep(120)
        multihost.sync_global_devices(f'step{step}')
      elif mode == 'allgather':
        out = multihost.process_allgather(data)
        assert out.shape == (jax.process_count(), n), out.shape
        assert (out[:, 0] == np.arange(jax.process_count())).all()
      elif mode == 'broadcast':
        out = multihost.broadcast_one_to_all(data)
        assert (out == 0).all()
      if step == 3:
        print('LOOPING', flush=True)
      step += 1
  except multihost.ProcessFailureError as e:
    print(f'RAISED ProcessFailureError failed={list(e.failed)} '
          f'at={time.time():.3f} message={e}', flush=True)
    sys.exit(3)
  except multihost.CollectiveTimeoutError as e:
    print(f'RAISED CollectiveTimeoutError missing={list(e.missing)} '
          f'message={e}', flush=True)
    sys.exit(4)


if __name__ == '__main__':
  main()
