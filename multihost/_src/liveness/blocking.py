"""Liveness: `call()`, which runs a blocking step of a collective in a step thread, under the watchdog.

`call` asks the runtime's watchdog (`Watchdog.call`), which runs the step
on its `Calls`: the step thread, the steps whose callers wait, and those
abandoned in C++. `Calls` asks the watchdog only what `Watcher` declares.
The calling thread waits for the step or for the watchdog (`liveness.watchdog`).
When the watchdog sees a peer gone, the caller raises `ProcessFailureError`
naming it (where every peer gone left normally, only once the step has not
ended within EXITED_GRACE_S), even if the step is stuck in C++: the step
thread is then abandoned (this process can no longer run collectives, but
it can save local state, log, and exit; the exit handshake waits a little
for it).
"""

from __future__ import annotations

from collections.abc import Callable
import queue
import threading
import time
from typing import Any
from typing import Protocol
from typing import TypeVar

from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import runtime as _runtime

_PEER_LOSS_MARKERS = ('Connection closed by peer', 'Connection reset by peer',
                      'Broken pipe', 'Connection refused')
# How long a step still running when a peer left normally may go on: the
# peer may have left right after its part of this very step (a barrier
# passed, after which this process's step thread had yet to run, or an
# Orbax commit, whose primary renames and writes after the others return).
# What is left of such a step is local and ends by itself; a step the peer
# never took part in raises once this has passed.
EXITED_GRACE_S = 5.0

T = TypeVar('T')  # What a watched step returns.


class Watcher(Protocol):
  """What a watched call asks of the watchdog (`liveness.watchdog.Watchdog` implements it)."""

  def gone(self) -> bool:
    """Whether a peer (or the service) is known to be gone."""
    ...

  def only_normal_exits(self) -> bool:
    """Whether every peer known gone left normally."""
    ...

  def failure_error(self, op: str, *, waited: float | None,
                    cause: BaseException | None = None
                    ) -> errors.ProcessFailureError:
    """A `ProcessFailureError` for `op` naming the processes known gone."""
    ...

  def wait_for_named_failure(self) -> None:
    """After a dropped connection, waits (bounded) for the watchdog to name it."""
    ...


def call(op: str, fn: Callable[..., T], *args: Any,
         timeout: float | None = None,
         runtime: _runtime.Runtime | None = None,
         met_elsewhere: bool = False) -> T:
  """Runs `fn(*args)`, a blocking step of collective `op`, watched for failures.

  Without a running watchdog (one process, or recoverability off) `fn`
  still runs on the step thread when there is a `timeout`, so the timeout
  holds on every path; with neither it is just `fn(*args)`. The runtime's
  watchdog runs it (`Watchdog.call`, on its `Calls`).

  Args:
    op: the collective's name, for error messages.
    fn: the blocking step (a coordination-service wait or a device
      collective); it runs in a step thread.
    *args: its arguments.
    timeout: seconds after which to give up on `fn` (None: never; use it for
      steps with no timeout of their own, such as gloo collectives).
    runtime: the process's runtime (default: the current one).
    met_elsewhere: the peers may have done their part already, not with
      `fn` (another library's call, whose background threads meet): then a
      peer that left normally before `fn` started gets EXITED_GRACE_S too,
      instead of a ProcessFailureError at once.

  Returns:
    What `fn` returns.

  Raises:
    ProcessFailureError: a peer failed (named) before `fn` completed (one
      that left normally: `fn` did not complete within EXITED_GRACE_S of
      it), or `fn` failed because a peer's connection dropped.
    CollectiveTimeoutError: `fn` did not complete within `timeout`.
    Whatever `fn` raises, otherwise.
  """
  rt = runtime or _runtime.current()
  return rt.watchdog.call(op, fn, *args, timeout=timeout,
                          met_elsewhere=met_elsewhere)


class Calls:
  """One process's watched calls: its step thread, the steps whose callers wait, the steps abandoned in C++, and the last step that failed.

  Owned by the watchdog, which wakes the waiting callers when it sees a
  peer gone (`wake`) and awaits the abandoned steps at exit.
  """

  def __init__(self) -> None:
    self._thread: _StepThread | None = None
    # The steps whose callers wait; set membership is atomic under the GIL.
    self._pending: set[_Step] = set()
    self._abandoned: list[_Step] = []
    self._failed_op: str | None = None

  def run(self, op: str, fn: Callable[..., T], args: tuple[Any, ...], *,
          watcher: Watcher, me: int, timeout: float | None,
          source: Callable[[float], str]) -> T:
    """Runs `fn(*args)` on the step thread until it ends, `watcher` sees a peer gone, or `timeout` passes (see `call`).

    Args:
      op: the collective's name, for error messages.
      fn: the blocking step.
      args: its arguments.
      watcher: the watchdog that wakes the caller when a peer is gone.
      me: this process's index, named in a timeout error.
      timeout: seconds after which to give up on `fn` (None: never).
      source: what set a timeout, as advice names it
        (`Runtime.timeout_source`).
    """
    step = _Step(fn, args)
    thread = self._thread
    if thread is None:
      thread = self._thread = _StepThread()
    start_time = time.monotonic()
    # The step's lock is released by the step thread when `fn` returns, or
    # by the watchdog when a peer is gone.
    self._pending.add(step)
    try:
      thread.submit(step)
      if not watcher.gone():
        step.wake.acquire(timeout=-1 if timeout is None else max(timeout, 0))
      if not step.done and watcher.gone():
        _grace_after_normal_exits(step, watcher, start_time, timeout)
    finally:
      self._pending.discard(step)
    if not step.done:
      self._thread = None  # It is stuck in `fn`; later calls get a new one.
      self._abandoned.append(step)
    waited = time.monotonic() - start_time
    if not step.done:
      self._failed_op = op  # A peer is stuck or gone (see `liveness.exit_handshake`).
      # (Without a timeout, only a peer gone ends the wait.)
      if watcher.gone() or timeout is None:
        raise watcher.failure_error(op, waited=waited)
      raise failures.step_timeout(op, me=me, waited=waited, timeout=timeout,
                                  source=source(timeout))
    if step.error is not None:
      if _is_peer_loss(step.error):
        self._failed_op = op
        watcher.wait_for_named_failure()
        raise watcher.failure_error(op, waited=time.monotonic() - start_time,
                                    cause=step.error) from step.error
      raise step.error
    self._failed_op = None
    return step.result

  def wake(self) -> None:
    """Wakes every caller waiting for its step (the watchdog saw a peer gone)."""
    for step in list(self._pending):
      step.notify()

  def failed_op(self) -> str | None:
    """The op of the last step that raised a timeout or a failure here (None once a later one completed)."""
    return self._failed_op

  def abandoned(self) -> bool:
    """Whether a step was abandoned in C++ (it may still be running)."""
    return bool(self._abandoned)

  def wait_for_abandoned(self, deadline: float) -> bool:
    """Waits until `deadline` (time.monotonic()) for the abandoned steps to end; returns whether they all did."""
    steps = list(self._abandoned)
    for step in steps:
      while not step.done and time.monotonic() < deadline:
        time.sleep(0.01)
    return all(s.done for s in steps)


def _grace_after_normal_exits(step: _Step, watcher: Watcher,
                              start_time: float,
                              timeout: float | None) -> None:
  """While the peers gone all left normally: waits up to EXITED_GRACE_S (and `timeout`) for `step`."""
  end = time.monotonic() + EXITED_GRACE_S
  if timeout is not None:
    end = min(end, start_time + max(timeout, 0))
  while not step.done and watcher.only_normal_exits():
    left = end - time.monotonic()
    if left <= 0:
      return
    # Woken by the step's end, or by the watchdog (a peer failed).
    step.wake.acquire(timeout=left)


class _Step:
  __slots__ = ('fn', 'args', 'done', 'result', 'error', 'wake')

  def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]):
    self.fn = fn
    self.args = args
    self.done = False
    self.result: Any = None
    self.error: BaseException | None = None
    self.wake = threading.Lock()
    self.wake.acquire()

  def notify(self) -> None:
    try:
      self.wake.release()
    except RuntimeError:  # Already released by the step thread or watchdog.
      pass


class _StepThread:
  """A daemon thread that runs steps one at a time."""

  def __init__(self) -> None:
    self._steps: queue.SimpleQueue[_Step] = queue.SimpleQueue()
    threading.Thread(target=self._run, name='multihost-collective',
                     daemon=True).start()

  def submit(self, step: _Step) -> None:
    self._steps.put(step)

  def _run(self) -> None:
    while True:
      step = self._steps.get()
      try:
        step.result = step.fn(*step.args)
      except BaseException as e:  # noqa: BLE001  Re-raised by the caller.
        step.error = e
      step.done = True
      step.notify()


def _is_peer_loss(error: BaseException) -> bool:
  message = str(error)
  return any(m in message for m in _PEER_LOSS_MARKERS)
