"""Signal forwarding: SIGINT/SIGTERM/SIGHUP to the launcher become a request to stop the run; SIGUSR1, a request for a where-report.

The handler only records the signal (it runs on the main thread, which may
hold the launcher's lock); the run's policy loop polls it.
"""

from __future__ import annotations

import collections.abc
import signal

# Asks every controller to print where it is (see `multihost.where`).
REPORT_SIGNAL = signal.SIGUSR1

# Signals the command-line launcher forwards to the controllers (SIGHUP: the
# terminal closed; the controllers, in their own sessions, would not get it).
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupts:
  """The signals the launcher received: the first one, and how many."""

  def __init__(self):
    self.first: int | None = None
    self.count = 0
    self.reports = 0  # REPORT_SIGNALs received
    self.reports_done = 0

  def record(self, signum: int) -> None:
    """Records a signal (safe in a signal handler: no locks)."""
    if self.first is None:
      self.first = signum
    self.count += 1

  def take_reports(self) -> bool:
    """Whether a REPORT_SIGNAL arrived since the last call."""
    pending = self.reports != self.reports_done
    self.reports_done = self.reports
    return pending

  def again(self) -> bool:
    """Whether a second signal arrived (stop at once)."""
    return self.count > 1

  def install(self) -> collections.abc.Callable[[], None]:
    """Makes FORWARDED_SIGNALS call `record`, REPORT_SIGNAL count a report (main thread only); returns the undo function."""
    previous = {}

    def handler(signum, frame):
      del frame
      self.record(signum)

    for sig in FORWARDED_SIGNALS:
      previous[sig] = signal.signal(sig, handler)

    def report_handler(signum, frame):
      del signum, frame
      self.reports += 1

    previous[REPORT_SIGNAL] = signal.signal(REPORT_SIGNAL, report_handler)

    def restore():
      for sig, old in previous.items():
        signal.signal(sig, old)

    return restore


def catches(pid: int, sig: int) -> bool:
  """Whether process `pid` handles `sig` (Linux: /proc/PID/status SigCgt); True where unknown."""
  try:
    with open(f'/proc/{pid}/status') as f:
      for line in f:
        if line.startswith('SigCgt:'):
          return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
  except (OSError, ValueError):
    pass
  return True
