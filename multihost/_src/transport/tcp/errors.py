"""Data plane: the named errors of the TCP transport (a link that could not be opened, a transfer that failed)."""

from __future__ import annotations

from collections.abc import Iterable
import socket
import time
from typing import Protocol

from multihost._src.runtime import errors
from multihost._src.runtime import failures


class Watched(Protocol):
  """What naming a failure asks of the runtime's watchdog."""

  def watching(self) -> bool:
    """Whether the watchdog runs (else nobody is ever named)."""
    ...

  def failed_within_bound(self, until: float | None = None) -> Iterable[int]:
    """The processes seen gone, waiting up to the detection bound (and not past `until`) for one."""
    ...


class Unreachable(Exception):
  """A connection to a peer's published address could not be opened.

  Raised under the plane's connector lock and named (`unreachable`) after
  it is released: naming waits up to the watchdog's bound for a dead peer,
  and another connector (a transfer behind the links' setup) must not wait
  meanwhile.
  """

  def __init__(self, address: str, error: OSError):
    super().__init__(address, error)
    self.address = address
    self.error = error


def unreachable(op: str, peer: int, address: str, error: OSError,
                liveness: Watched) -> errors.MultihostError:
  """A named error for a connection to `peer` that could not be opened."""
  if isinstance(error, (socket.timeout, TimeoutError)):
    return failures.connect_timeout(op, peer, address)
  dead = list(liveness.failed_within_bound())
  if dead:  # refused because the peer is gone
    return failures.connection_failure(op, peer, error, dead)
  return failures.cannot_connect(op, peer, address, error)


def peer_error(op: str, peer: int, error: BaseException, liveness: Watched, *,
               waiting: bool = False,
               deadline: float | None = None) -> errors.MultihostError:
  """A named error for a failed transfer with `peer`; `liveness` (the runtime's watchdog) names a dead process.

  A broken connection waits for the watchdog to name a dead process, up to
  its detection bound, but not past the transfer's `deadline` (if given):
  a peer that timed out itself closes its connections, and the processes
  still waiting on it then time out in their own time too, not the
  watchdog's.
  """
  if isinstance(error, errors.MultihostError):
    return error
  if isinstance(error, Unreachable):
    return unreachable(op, peer, error.address, error.error, liveness)
  if isinstance(error, (socket.timeout, TimeoutError)) or waiting:
    return failures.transfer_timeout(op, peer,
                                         'to send or receive its part')
  # The watchdog names the dead process within its bound; wait for it.
  dead = list(liveness.failed_within_bound(until=deadline))
  if not dead and deadline is not None and time.monotonic() >= deadline:
    return failures.transfer_timeout(
        op, peer, 'to send or receive its part (its connection broke: '
        f'{type(error).__name__}: {error}; no process is known to have '
        'failed: it may have timed out itself)')
  if not dead and liveness.watching():  # every process is alive
    return failures.connection_cut(op, peer, error)
  return failures.connection_failure(op, peer, error, dead or [peer])
