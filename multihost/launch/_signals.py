"""Signal forwarding: SIGINT/SIGTERM/SIGHUP to the launcher become a request to stop the run.

The handler only records the signal (it runs on the main thread, which may
hold the launcher's lock); the run's policy loop polls it.
"""

from __future__ import annotations

import collections.abc
import signal

# Signals the command-line launcher forwards to the controllers (SIGHUP: the
# terminal closed; the controllers, in their own sessions, would not get it).
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupts:
  """The signals the launcher received: the first one, and how many."""

  def __init__(self):
    self.first: int | None = None
    self.count = 0

  def record(self, signum: int) -> None:
    """Records a signal (safe in a signal handler: no locks)."""
    if self.first is None:
      self.first = signum
    self.count += 1

  def again(self) -> bool:
    """Whether a second signal arrived (stop at once)."""
    return self.count > 1

  def install(self) -> collections.abc.Callable[[], None]:
    """Makes FORWARDED_SIGNALS call `record` (main thread only); returns the undo function."""
    previous = {}

    def handler(signum, frame):
      del frame
      self.record(signum)

    for sig in FORWARDED_SIGNALS:
      previous[sig] = signal.signal(sig, handler)

    def restore():
      for sig, old in previous.items():
        signal.signal(sig, old)

    return restore
