"""How a failed transfer is named (`transport.tcp.errors.peer_error`), with a stand-in for the watchdog (our own `Watched` Protocol)."""

from __future__ import annotations

import time

from multihost._src import api  # noqa: F401  (assembles the runtime the messages name)
from multihost._src.runtime import errors
from multihost._src.transport.tcp import errors as tcp_errors


class _Watchdog:
  """Names `dead` once `after` seconds have passed since it was made; records how long a caller was willing to wait."""

  def __init__(self, dead: tuple[int, ...], after: float, bound: float):
    self.dead, self.after, self.bound = dead, after, bound
    self.start = time.monotonic()
    self.until: list[float | None] = []

  def watching(self) -> bool:
    return True

  def failed_within_bound(self, until: float | None = None) -> tuple[int, ...]:
    self.until.append(until)
    end = self.start + self.bound
    if until is not None:
      end = min(end, until)
    named_at = self.start + self.after
    time.sleep(max(0.0, min(end, named_at) - time.monotonic()))
    return self.dead if time.monotonic() >= named_at else ()


def test_a_broken_connection_names_the_dead_process_the_watchdog_names():
  stand_in = _Watchdog((3,), after=0.05, bound=5.0)
  e = tcp_errors.peer_error('broadcast_one_to_all', 1,
                            ConnectionResetError('reset'), stand_in,
                            deadline=time.monotonic() + 10.0)
  assert isinstance(e, errors.ProcessFailureError), e
  assert list(e.failed) == [3], e


def test_a_broken_connection_waits_no_longer_than_the_transfers_deadline():
  # A peer that timed out closes its links; nobody will be named (the
  # stand-in names no one within its 5 s bound): the transfer times out at
  # its own deadline, naming the peer and what broke.
  stand_in = _Watchdog((), after=60.0, bound=5.0)
  start = time.monotonic()
  e = tcp_errors.peer_error('broadcast_one_to_all', 0,
                            ConnectionResetError('reset by peer'), stand_in,
                            deadline=start + 0.2)
  took = time.monotonic() - start
  assert isinstance(e, errors.CollectiveTimeoutError), e
  assert list(e.missing) == [0], e
  assert 'process 0' in str(e) and 'ConnectionResetError' in str(e), e
  assert 0.15 < took < 2.0, took


def test_without_a_deadline_a_broken_connection_waits_the_whole_bound():
  stand_in = _Watchdog((), after=60.0, bound=0.3)
  start = time.monotonic()
  e = tcp_errors.peer_error('process_allgather', 2, BrokenPipeError('pipe'),
                            stand_in)
  assert 0.25 < time.monotonic() - start < 2.0
  assert stand_in.until == [None]
  assert not isinstance(e, errors.CollectiveTimeoutError), e
  assert 'no process is known to have failed' in str(e), e
