"""Liveness: `call()`, which runs a blocking step of a collective in a step thread, under the watchdog.

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


def call(op: str, fn: Callable[..., Any], *args: Any,
         timeout: float | None = None,
         runtime: _runtime.Runtime | None = None,
         met_elsewhere: bool = False) -> Any:
  """Runs `fn(*args)`, a blocking step of collective `op`, watched for failures.

  Without a running watchdog (one process, or recoverability off) `fn`
  still runs on the step thread when there is a `timeout`, so the timeout
  holds on every path; with neither it is just `fn(*args)`.

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
  wd = rt.watchdog
  if not wd.running and not wd.ensure_started():
    if timeout is None:
      return fn(*args)
    wd.me = rt.index  # Named in the timeout error.
  elif not (met_elsewhere and wd.only_normal_exits()):
    wd.check(op)
  step = _Step(fn, args)
  thread = wd.step_thread
  if thread is None:
    thread = wd.step_thread = _StepThread()
  start_time = time.monotonic()
  # The step's lock is released by the step thread when `fn` returns, or by
  # the watchdog when a peer is gone; set membership is atomic under the GIL.
  wd.pending.add(step)
  try:
    thread.submit(step)
    if not wd.gone():
      step.wake.acquire(timeout=-1 if timeout is None else max(timeout, 0))
    if not step.done and wd.gone():
      _grace_after_normal_exits(step, wd, start_time, timeout)
  finally:
    wd.pending.discard(step)
  if not step.done:
    wd.step_thread = None  # It is stuck in `fn`; later calls get a new one.
    wd.abandoned = True
    wd.abandoned_steps.append(step)
  waited = time.monotonic() - start_time
  if not step.done:
    wd.step_failed = op  # A peer is stuck or gone (see `liveness.exit_handshake`).
    if wd.gone():
      raise wd.failure_error(op, waited=waited)
    raise failures.step_timeout(op, me=wd.me, waited=waited,
                                    timeout=timeout,
                                    source=rt.timeout_source(timeout))
  if step.error is not None:
    if _is_peer_loss(step.error):
      wd.step_failed = op
      wd.wait_for_named_failure()
      raise wd.failure_error(op, waited=time.monotonic() - start_time,
                             cause=step.error) from step.error
    raise step.error
  wd.step_failed = None
  return step.result


def _grace_after_normal_exits(step: _Step, wd: Any, start_time: float,
                              timeout: float | None) -> None:
  """While the peers gone all left normally: waits up to EXITED_GRACE_S (and `timeout`) for `step`."""
  end = time.monotonic() + EXITED_GRACE_S
  if timeout is not None:
    end = min(end, start_time + max(timeout, 0))
  while not step.done and wd.only_normal_exits():
    left = end - time.monotonic()
    if left <= 0:
      return
    # Woken by the step's end, or by the watchdog (a peer failed).
    step.wake.acquire(timeout=left)


class _Step:
  __slots__ = ('fn', 'args', 'done', 'result', 'error', 'wake')

  def __init__(self, fn, args):
    self.fn = fn
    self.args = args
    self.done = False
    self.result = None
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

  def __init__(self):
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
