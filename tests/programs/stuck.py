"""One process stuck in user code (stuck_in_data_loader) while the others wait at a barrier, then an all-gather.

Usage: stuck.py STUCK TIMEOUT STALL MODE. The waiting processes print
BARRIER-ERROR/GATHER-ERROR with their timeouts' text; MODE 'where' also has
process 0 print `multihost.where()` (WHERE-REPORT). Then STUCK comes last,
30 ms late, to 12 barriers, and every process prints its straggler report.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import multihost
from multihost import lowlevel


def stuck_in_data_loader(seconds: float) -> None:
  print('STUCK', flush=True)
  time.sleep(seconds)


def main() -> None:
  stuck, timeout, stall = (int(sys.argv[1]), float(sys.argv[2]),
                           float(sys.argv[3]))
  where = sys.argv[4] == 'where'
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)

  me = jax.process_index()
  multihost.set_stall_report_after(stall)

  def phase(tag, call):
    if me == stuck:
      stuck_in_data_loader(timeout + 4)
      try:  # Arrives late; consumes the same call number as the others.
        call(0.5)
      except multihost.MultihostError:
        pass
    else:
      if me == 0 and where and tag == 'BARRIER':
        time.sleep(0.5)
        print('WHERE-REPORT\n' + multihost.where(), flush=True)
      try:
        call(timeout)
        print(f'{tag}-NO-ERROR', flush=True)
      except multihost.CollectiveTimeoutError as e:
        print(f'{tag}-ERROR ' + ' '.join(str(e).split()), flush=True)
    lowlevel.wait_at_barrier(f'realign-{tag}', 60)

  multihost.sync_global_devices('warm up')
  phase('BARRIER',
        lambda t: multihost.sync_global_devices('before step 1', timeout=t))
  x = np.arange(3.0)
  multihost.process_allgather(x)
  phase('GATHER', lambda t: multihost.process_allgather(x, timeout=t))
  for i in range(12):  # Then the stuck process comes last, 30 ms late.
    if me == stuck:
      time.sleep(0.03)
    multihost.sync_global_devices(f'step {i}')
  report = multihost.straggler_report()
  print(f'STRAGGLER {report.consistently_last} {report.summary()}',
        flush=True)
  multihost.sync_global_devices('done')
  print('DONE', flush=True)


if __name__ == '__main__':
  main()
