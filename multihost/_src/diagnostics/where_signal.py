"""Diagnostics: on SIGUSR1, a daemon thread prints this process's where-report to stderr.

Python runs signal handlers on the main thread only, which may be stuck;
but its C-level handler also writes the signal's number to the wakeup fd at
once, from any thread, and a daemon thread waits on that.
"""

from __future__ import annotations

from collections.abc import Callable
import os
import select
import signal
import sys
import threading


def install(report: Callable[[], str]) -> None:
  """Prints `report()` to stderr on every SIGUSR1, from a daemon thread.

  Installed only from the main thread, when SIGUSR1 has its default action
  and no wakeup fd is set (otherwise someone else owns them).
  """
  if threading.current_thread() is not threading.main_thread():
    return
  if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
    return
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  try:
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  except ValueError:
    os.close(read_fd)
    os.close(write_fd)
    return
  if previous != -1:  # Someone else's: put it back.
    signal.set_wakeup_fd(previous)
    os.close(read_fd)
    os.close(write_fd)
    return
  signal.signal(signal.SIGUSR1, lambda signum, frame: None)
  threading.Thread(target=_report_on_signal, args=(read_fd, report),
                   name='multihost-where-signal', daemon=True).start()


def _report_on_signal(read_fd: int, report: Callable[[], str]) -> None:
  while True:
    select.select([read_fd], [], [])
    data = os.read(read_fd, 512)
    if signal.SIGUSR1 in data:
      try:
        sys.stderr.write(report() + '\n')
        sys.stderr.flush()
      except Exception:  # noqa: BLE001
        pass
