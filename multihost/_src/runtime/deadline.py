"""Deadlines as values: one wait's operation, when it ends, and the liveness check between its slices.

A collective makes one `Deadline` and passes it down to the socket code,
which checks it between the short slices it waits in: a peer known to be
gone raises `ProcessFailureError` (through the `Liveness` given, the
runtime's watchdog), the end raises `TimeoutError`. Nothing below reaches
for the watchdog or the current runtime itself, so one runtime per thread
(as tests build them) holds all the way down.
"""

from __future__ import annotations

from collections.abc import Callable
import time
from typing import Protocol


class Liveness(Protocol):
  """What a wait asks between its slices (the runtime's watchdog implements it)."""

  def check(self, op: str) -> None:
    """Raises ProcessFailureError for `op` once a peer is known to be gone."""
    ...


class Deadline:
  """When a wait of operation `op` ends (`at`, time.monotonic()), and whom to ask whether its peers live.

  `idle`, if given, runs between the slices of a read that has received
  nothing yet, instead of the plain check: it may raise (the agreement's
  diagnosis, late marks and its named timeout live there).
  """

  __slots__ = ('op', 'at', 'liveness', 'idle')

  def __init__(self, op: str, at: float, liveness: Liveness | None = None, *,
               idle: Callable[[], None] | None = None):
    self.op = op
    self.at = at
    self.liveness = liveness
    self.idle = idle

  def check(self) -> None:
    """Raises ProcessFailureError once a peer is known to be gone (between slices)."""
    if self.liveness is not None:
      self.liveness.check(self.op)

  def expired(self) -> bool:
    """Whether the deadline has passed."""
    return time.monotonic() >= self.at

  def left(self) -> float:
    """Seconds until the deadline (0 once passed)."""
    return max(self.at - time.monotonic(), 0.0)
