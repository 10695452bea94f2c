"""The agreement over the TCP links with real controllers: argv MODE[,MODE...] SLEEPER[,SLEEPER...].

Per MODE (and its SLEEPER), in order: prints MODE <mode>, calls until every
process agrees over the links (prints LINKS), then: mismatch (process
SLEEPER passes another barrier name: ConsistencyError everywhere); skew
(SLEEPER arrives 7.5 s late at a 6 s all-gather, then two more calls that
must complete everywhere); eager (a default-source broadcast, whose source
sends its first stripe during the agreement: SLEEPER, the next process in
the chain, passes another shape, then another source, and
ConsistencyError is raised everywhere with the links kept open; then
SLEEPER arrives 9 s late at a 6 s broadcast, and the next ones complete
everywhere). Exits 0 after PASSED.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import multihost
from multihost._src.runtime import runtime

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _links  # noqa: E402  (a sibling module, found by path)


def drill(mode: str, sleeper: int, me: int) -> None:
  """One MODE, once the processes agree over the links."""
  print(f'MODE {mode}', flush=True)
  up = _links.wait_until_up(f'setup {mode}')
  print(f'LINKS {up}', flush=True)
  if mode == 'mismatch':
    try:
      multihost.sync_global_devices('odd' if me == sleeper else 'even',
                                    timeout=20)
    except multihost.ConsistencyError as e:
      print(f'RAISED ConsistencyError {e}', flush=True)
    out = multihost.process_allgather(np.int32(me), timeout=20)
    print(f'AFTER ok {out.tolist()}', flush=True)
  if mode == 'eager':
    eager(sleeper, me)
  if mode == 'skew':
    for i in range(3):
      if i == 0 and me == sleeper:
        time.sleep(7.5)
      start = time.monotonic()
      try:
        out = multihost.process_allgather(np.int32(me), timeout=6)
        print(f'STEP {i} ok {out.tolist()}', flush=True)
      except multihost.CollectiveTimeoutError as e:
        print(f'STEP {i} timeout after={time.monotonic() - start:.2f} '
              f'missing={list(e.missing)} message={e}', flush=True)


def _conns() -> dict:
  return dict(runtime.current().plane.conns)


def eager(sleeper: int, me: int) -> None:
  """The 'eager' MODE (see the module docstring)."""
  # 1 MiB (one stripe), 8 MiB (two), 64 MiB (two, each more than the
  # sockets hold: the rest of the first is sent while the next process
  # reads, after the ConsistencyError)
  for n in (1 << 18, 2 << 20, 16 << 20):
    x = np.arange(n, dtype=np.float32) + me
    multihost.broadcast_one_to_all(x)  # the lanes' links open
    before = _conns()
    for case, arg, kwargs in (
        ('shape', x[:-1] if me == sleeper else x, {}),
        # Agrees (process 0 is the source either way) after a difference:
        # the stripe sent early serves the transfer.
        ('source', x, {'is_source': False} if me == sleeper else {}),
        ('sources', x, {'is_source': True} if me == sleeper else {})):
      try:
        multihost.broadcast_one_to_all(arg, timeout=20, **kwargs)
        print(f'EAGER {n} {case} not raised', flush=True)
      except multihost.ConsistencyError as e:
        print(f'EAGER {n} {case} RAISED {str(e)[:160]}', flush=True)
      got = multihost.broadcast_one_to_all(x, timeout=20)
      assert (got == np.arange(n, dtype=np.float32)).all(), (n, case)
    print(f'EAGER {n} SAME LINKS {_conns() == before}', flush=True)
  # 16 MiB: more of the first stripe (8 MiB) than a socket takes at once,
  # so the source's timed-out call leaves its link owing the rest.
  x = np.arange(4 << 20, dtype=np.float32) + me
  # All start together: where the others finish the checks above 1.5 s or
  # more after the sleeper, its sleep ends within their 6 s (seen under load:
  # every process then reported LATE 0 ok).
  multihost.sync_global_devices('eager late', timeout=60)
  for i in range(3):
    if i == 0 and me == sleeper:
      time.sleep(9)
    try:
      got = multihost.broadcast_one_to_all(x, timeout=6)
      assert (got == np.arange(4 << 20, dtype=np.float32)).all(), i
      print(f'EAGER LATE {i} ok', flush=True)
    except multihost.MultihostError as e:
      print(f'EAGER LATE {i} {type(e).__name__} {e}', flush=True)


def main() -> None:
  modes = sys.argv[1].split(',')
  sleepers = [int(s) for s in sys.argv[2].split(',')]
  multihost.initialize(heartbeat_timeout_seconds=3)
  import jax  # noqa: PLC0415 (after initialize)
  me = jax.process_index()
  for mode, sleeper in zip(modes, sleepers, strict=True):
    drill(mode, sleeper, me)
  print('PASSED', flush=True)


if __name__ == '__main__':
  main()
