"""A default-source broadcast whose source gives its agreement up while the others complete it: argv LATE.

Process 0 (the source, which sends its first stripe during the agreement:
`transport.tcp.eager.Eager`) waits 4 s; process LATE arrives 4.4 s late,
the others 1 s late with a 6 s timeout, so they still complete the
agreement once LATE's frames come. Process 0's gave-up mark is written 2 s
late (the window between its deadline check and the mark being visible,
widened), so LATE does not see it and sends its frames: every process but
the source completes the agreement. Per payload size (1 MiB: the whole
stripe fits in what is sent early; 16 MiB: it does not), prints
`CALL <size> <i> ok` or `CALL <size> <i> <error type> <message>` for the
broadcast with the late arrivals (i = 0) and two on-time ones after it
(i = 1, 2), whose result must be all-or-none too. Exits 0 after PASSED.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import multihost
from multihost._src.auth import marks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _links  # noqa: E402  (a sibling module, found by path)


def _delay_marks(seconds: float) -> None:
  """Makes this process's gave-up marks visible `seconds` after it gave up."""
  real = marks.leave_mark

  def delayed(*args, **kwargs):
    time.sleep(seconds)
    return real(*args, **kwargs)

  marks.leave_mark = delayed


def main() -> None:
  late = int(sys.argv[1])
  multihost.initialize(heartbeat_timeout_seconds=3)
  import jax  # noqa: PLC0415 (after initialize)
  me = jax.process_index()
  # Until the links are set up (every process switches in the same call).
  up = _links.wait_until_up('setup')
  print(f'LINKS {up}', flush=True)
  if me == 0:
    _delay_marks(2.0)
  for n in (1 << 18, 4 << 20):  # float32s: 1 MiB, 16 MiB
    x = np.arange(n, dtype=np.float32) + me
    want = np.arange(n, dtype=np.float32)
    multihost.broadcast_one_to_all(x, timeout=30)  # the lanes' links open
    multihost.sync_global_devices(f'start {n}', timeout=30)
    for i in range(3):
      timeout = 30.0
      if i == 0:
        delay, timeout = {0: (0.0, 4.0), late: (4.4, 6.0)}.get(me, (1.0, 6.0))
        time.sleep(delay)
      try:
        got = multihost.broadcast_one_to_all(x, timeout=timeout)
        assert np.array_equal(got, want), (n, i)
        print(f'CALL {n} {i} ok', flush=True)
      except multihost.MultihostError as e:
        print(f'CALL {n} {i} {type(e).__name__} {e}', flush=True)
    # Every process is past the three calls before the next size starts:
    # a process that raised at once must not run into the next one alone.
    multihost.sync_global_devices(f'end {n}', timeout=60)
  print('PASSED', flush=True)


if __name__ == '__main__':
  main()
