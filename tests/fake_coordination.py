"""An in-memory coordination service for unit tests: threads stand for processes.

`FakeService` keeps one key-value store and the barriers of a job of
`count` processes; `FakeService.client(p)` is process p's view of it, a
`multihost._src.runtime.coordination.Client`. It answers the way JAX's coordination
service does where the control plane depends on it:

* a barrier waits for every process (or the ones named); at its deadline
  (the first arrival's timeout) every process waiting there gets
  `DEADLINE_EXCEEDED: Barrier timed out ...` naming those that did not
  arrive as `/job:jax_worker/replica:0/task:N`, and the id may then be used
  again (a new barrier);
* a key-value get that times out raises `DEADLINE_EXCEEDED`;
* a killed process's own calls raise `UNAVAILABLE`, the others' barriers
  keep waiting for it (recoverability on), and `live_processes` leaves it
  out (the real service does once its heartbeats stop), as it leaves out a
  process that disconnected (`disconnect`, JAX's client shutdown).

It checks deadlines exactly (the real service does about once a second) and
answers `live_processes` at once (the real one waits for every live process
to ask). `runtimes(n)` builds the `multihost._src.runtime.runtime.Runtime` of each
process on one service.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
import threading
import time
from typing import Any

import multihost._src.api  # noqa: F401  Registers the runtimes' parts.
from multihost._src.control import links as _control_links
from multihost._src.runtime import runtime
from multihost._src.transport.tcp import link


class FakeServiceError(RuntimeError):
  """What the fake raises where JAX's client raises JaxRuntimeError."""


class _Barrier:
  __slots__ = ('expected', 'arrived', 'deadline', 'first', 'done', 'error')

  def __init__(self, expected: set[int], deadline: float, first: int):
    self.expected = expected
    self.arrived: set[int] = set()
    self.deadline = deadline
    self.first = first
    self.done = False
    self.error: str | None = None


class FakeService:
  """One job's coordination service, in memory (see the module docstring)."""

  def __init__(self, count: int):
    self.count = count
    self.cond = threading.Condition()
    self.store: dict[str, bytes] = {}
    self.barriers: dict[str, _Barrier] = {}
    self.dead: set[int] = set()
    self.disconnected: set[int] = set()
    # (key, value, process) -> the value stored: a man in the middle.
    self.tamper: Callable[[str, bytes, int], bytes] | None = None

  def client(self, process: int) -> FakeClient:
    return FakeClient(self, process)

  def kill(self, process: int) -> None:
    """`process` dies: its calls fail; the others see it gone."""
    with self.cond:
      self.dead.add(process)
      self.cond.notify_all()


def _timed_out(barrier_id: str, b: _Barrier) -> str:
  missing = sorted(b.expected - b.arrived)
  names = '\n'.join(f'/job:jax_worker/replica:0/task:{t}' for t in missing)
  return (f'DEADLINE_EXCEEDED: Barrier timed out. Id: {barrier_id}. This '
          'usually happens because a task triggered the barrier too early or '
          'too slowly. Please look at the task logs (both timed out and first '
          'task) to debug further.\n# of tasks that reached the barrier: '
          f'{len(b.arrived)}/{len(b.expected)}.\nThe first task at the '
          f'barrier: {b.first}. Some timed out task names:\n{names}')


class FakeClient:
  """Process `me`'s client of a `FakeService` (a `runtime.coordination.Client`)."""

  def __init__(self, service: FakeService, me: int):
    self.service = service
    self.me = me
    self.connected = True

  def disconnect(self) -> None:
    """Ends this process's calls in flight, as JAX's client shutdown does."""
    with self.service.cond:
      self.connected = False
      self.service.disconnected.add(self.me)
      self.service.cond.notify_all()

  def _alive(self) -> None:
    if self.me in self.service.dead or not self.connected:
      raise FakeServiceError(
          f'UNAVAILABLE: task:{self.me} is not connected to the '
          'coordination service')

  def kv_set(self, key: str, value: bytes) -> None:
    s = self.service
    with s.cond:
      self._alive()
      if s.tamper is not None:
        value = s.tamper(key, value, self.me)
      s.store[key] = bytes(value)
      s.cond.notify_all()

  def kv_create(self, key: str, value: bytes) -> bool:
    s = self.service
    with s.cond:
      self._alive()
      if key in s.store:
        return False
      if s.tamper is not None:
        value = s.tamper(key, value, self.me)
      s.store[key] = bytes(value)
      s.cond.notify_all()
      return True

  def kv_get(self, key: str, timeout: float) -> bytes:
    s = self.service
    deadline = time.monotonic() + timeout
    with s.cond:
      while True:
        self._alive()
        if key in s.store:
          return s.store[key]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          raise FakeServiceError(
              f'DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key} '
              f'and duration: {timeout:g}s')
        s.cond.wait(remaining)

  def kv_try_get(self, key: str) -> bytes | None:
    with self.service.cond:
      self._alive()
      return self.service.store.get(key)

  def kv_dir(self, prefix: str) -> list[tuple[str, bytes]]:
    with self.service.cond:
      self._alive()
      return sorted((k, v) for k, v in self.service.store.items()
                    if k.startswith(prefix))

  def kv_delete(self, key: str) -> None:
    s = self.service
    with s.cond:
      self._alive()
      for k in [k for k in s.store if k == key or
                (key.endswith('/') and k.startswith(key))]:
        del s.store[k]

  def kv_increment(self, key: str, by: int) -> int:
    s = self.service
    with s.cond:
      self._alive()
      value = int(s.store.get(key, b'0')) + by
      s.store[key] = str(value).encode()
      s.cond.notify_all()
      return value

  def wait_at_barrier(self, barrier_id: str, timeout: float,
                      process_ids: Sequence[int] | None = None) -> None:
    s = self.service
    with s.cond:
      self._alive()
      b = s.barriers.get(barrier_id)
      if b is None or b.done:  # A new barrier (or the id used again).
        expected = set(range(s.count) if process_ids is None else process_ids)
        b = _Barrier(expected, time.monotonic() + timeout, self.me)
        s.barriers[barrier_id] = b
      b.arrived.add(self.me)
      if b.arrived >= b.expected:
        b.done = True
        s.cond.notify_all()
      while not b.done:
        self._alive()
        remaining = b.deadline - time.monotonic()
        if remaining <= 0:
          b.done = True
          b.error = _timed_out(barrier_id, b)
          s.cond.notify_all()
          break
        s.cond.wait(remaining)
      if b.error is not None:
        raise FakeServiceError(b.error)

  def live_processes(self, process_ids: Sequence[int]) -> list[int]:
    with self.service.cond:
      self._alive()
      s = self.service
      return sorted(set(process_ids) - s.dead - s.disconnected)


def runtimes(count: int, *, links: bool = False
             ) -> tuple[FakeService, list[runtime.Runtime]]:
  """A fake service and the runtime of each of its `count` processes.

  With `links`, calls agree over real TCP links on loopback once the first
  call met through the service (as in a real job); else always through the
  service.
  """
  service = FakeService(count)
  rts = [runtime.Runtime(service.client(p), index=p, count=count,
                          recoverable=True, runs_service=p == 0,
                          service_address='127.0.0.1:1')
         for p in range(count)]
  if not links:
    for rt in rts:
      _control_links.service_only(rt)
  return service, rts


def run(rts: list[runtime.Runtime], fn: Callable[[runtime.Runtime], Any], *,
        timeout: float = 30.0,
        delays: dict[int, float] | None = None) -> list[tuple[Any, float]]:
  """`fn(rt)` on a thread per process; each one's (result or exception, seconds).

  `delays` holds back the start of some processes (seconds). Raises
  AssertionError if a thread is still running after `timeout`.
  """
  results: list[Any] = [None] * len(rts)
  delays = delays or {}

  def body(i: int) -> None:
    time.sleep(delays.get(i, 0.0))
    start = time.monotonic()
    try:
      out = fn(rts[i])
    except BaseException as e:  # noqa: BLE001  Returned to the test.
      out = e
    results[i] = (out, time.monotonic() - start)

  threads = [threading.Thread(target=body, args=(i,), daemon=True,
                              name=f'fake-process-{i}')
             for i in range(len(rts))]
  for t in threads:
    t.start()
  deadline = time.monotonic() + timeout
  for t in threads:
    t.join(max(0.0, deadline - time.monotonic()))
  stuck = [i for i, t in enumerate(threads) if t.is_alive()]
  assert not stuck, f'fake processes {stuck} still running after {timeout} s'
  return results


def stop(rts: list[runtime.Runtime]) -> None:
  """Stops every runtime's threads (the responders and the watchdogs)."""
  for rt in rts:
    if rt.watchdog is not None:
      rt.watchdog.stop_polling(wait=False)
  for rt in rts:
    if rt.where is not None:
      rt.where.stop()
    if rt.watchdog is not None:
      rt.watchdog.stop_polling()
    if rt.plane is not None:
      link.close_plane(rt.plane)
