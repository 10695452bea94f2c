"""One process stuck in user code (stuck_in_data_loader) while the others wait at a barrier, then an all-gather.

Usage: stuck.py STUCK TIMEOUT STALL MODE. The waiting processes print
BARRIER-ERROR/GATHER-ERROR with their timeouts' text; MODE 'where' also has
process 0 print `multihost.where()` (WHERE-REPORT). STUCK stays in
stuck_in_data_loader until every other process has printed its error (or
TIMEOUT + 4 s). Then STUCK comes last, 30 ms late, to 12 barriers, and every
process prints its straggler report.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

import multihost
from multihost import lowlevel


def stuck_in_data_loader(seconds: float, released: list) -> None:
  print('STUCK', flush=True)
  deadline = time.monotonic() + seconds
  # Only C calls in this loop: a where report samples the main thread here.
  while not released and time.monotonic() < deadline:
    time.sleep(0.05)


def _release_when_reported(tag: str, others: int, released: list,
                           seconds: float) -> None:
  """Appends to `released` once `others` processes have printed their error."""
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    if len(lowlevel.key_value_dir(f'reported-{tag}/')) >= others:
      released.append(True)
      return
    time.sleep(0.05)


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
      released = []
      watcher = threading.Thread(
          target=_release_when_reported, daemon=True,
          args=(tag, jax.process_count() - 1, released, timeout + 4))
      watcher.start()
      stuck_in_data_loader(timeout + 4, released)
      watcher.join()
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
      lowlevel.key_value_set(f'reported-{tag}/{me}', b'')
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
