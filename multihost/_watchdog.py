"""Failure and diagnostics: the watchdog that sees a peer die, and `call()`, which runs blocking steps under it.

When a peer is killed, JAX does not tell the survivors in a way Python can
catch: with `jax_enable_recoverability` off, every survivor is aborted
(SIGABRT) at the heartbeat timeout; with it on, nothing is aborted, but a
coordination-service barrier waits for the dead process until its own
timeout, and a gloo device collective waits forever on every process that is
not a ring neighbour of the dead one (neighbours get "Connection closed by
peer" at once). Measured on JAX 0.10.2; see the README's failure section.

So, with recoverability on (`multihost.initialize()` turns it on):

* A daemon thread per process (the watchdog) asks the coordination service
  which processes are alive, every `POLL_INTERVAL_S`. The service drops a
  process when its heartbeats stop for `heartbeat_timeout` seconds, so a
  failure is seen within about heartbeat_timeout + POLL_INTERVAL_S.
* Every blocking step of a collective runs through `call()`: in a worker
  thread, while the calling thread waits for it or for the watchdog. When the
  watchdog sees a peer gone, the caller raises `ProcessFailureError` naming
  it, even if the worker is stuck in C++ (it is abandoned: this process can
  no longer run collectives, but it can save local state, log, and exit).
* Once a failure is known, every later collective raises at once (`check`).
* At exit, each process records that it is leaving, so a peer that exits
  normally is reported as "exited", not "failed"; and process 0, which hosts
  the service, waits for the others to leave before it takes the service
  down with it (the shutdown barrier JAX skips when recoverability is on).

Process 0 is special when it hosts the coordination service (JAX's
default): when it dies, the C++ client of every other process aborts the
process (SIGABRT, "Terminating process because the JAX distributed service
detected fatal errors") about 1 ms after the connection drops, before any
Python code can run; a Python `missed_heartbeat_callback` cannot replace that
abort in jaxlib 0.10.2 (its status argument fails to convert: std::bad_cast,
then std::terminate). The launcher reports it (process 0 died first). When a
launcher hosts the service instead (`_coordination.start_service` and
$MULTIHOST_EXTERNAL_SERVICE=1), process 0's death is an ordinary failure.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from absl import logging
import jax

from multihost import _companion
from multihost import _coordination
from multihost import _diagnostics
from multihost import _errors

POLL_INTERVAL_S = 0.5
# At exit, how long abandoned collectives get to return (see `_at_exit`).
_EXIT_GRACE_S = 5.0
# Where each process records a normal exit in the key-value store.
_EXIT_DIR = 'multihost_exit/'
# Errors from a device collective whose peer went away.
_PEER_LOSS_MARKERS = ('Connection closed by peer', 'Connection reset by peer',
                      'Broken pipe', 'Connection refused')


class _State:
  """What the watchdog knows; guarded by `cond`."""

  def __init__(self):
    self.cond = threading.Condition()
    self.running = False
    self.stopping = False
    self.me = 0
    self.count = 1
    self.heartbeat_timeout = 100.0
    self.shutdown_timeout = 300.0
    self.failed: dict[int, float] = {}  # process -> time.monotonic() seen.
    self.exited: set[int] = set()
    self.service_lost = False
    self.thread: threading.Thread | None = None
    self.worker: _Worker | None = None
    self.pending: set[_Job] = set()  # Jobs whose callers are waiting.
    self.abandoned = False  # A worker is stuck in a collective.
    self.abandoned_jobs: list[_Job] = []


_state = _State()


def recoverability_enabled() -> bool:
  """Whether `jax_enable_recoverability` is on (set it before initialize)."""
  return bool(jax.config.jax_enable_recoverability)


def is_running() -> bool:
  return _state.running


def detection_bound() -> float:
  """Seconds within which the watchdog reports a peer that was killed."""
  return _state.heartbeat_timeout + 2 * POLL_INTERVAL_S + 1.0


def start(*, heartbeat_timeout: float, shutdown_timeout: float = 300.0) -> bool:
  """Starts the watchdog (once); returns whether it runs.

  It runs only with more than one process, `jax.distributed` initialized and
  `jax_enable_recoverability` on (without it, JAX aborts the survivors
  itself). Every process must start it: asking the service which processes
  are alive is a rendezvous of all live processes.

  Args:
    heartbeat_timeout: the `heartbeat_timeout_seconds` given to
      `jax.distributed.initialize` (bounds the detection time).
    shutdown_timeout: how long process 0 waits at exit for the others.
  """
  st = _state
  with st.cond:
    if st.running:
      return True
    if (st.stopping  # After `_at_exit`: never start again.
        or _coordination.client() is None or jax.process_count() == 1
        or not recoverability_enabled()):
      return False
    st.me = jax.process_index()
    st.count = jax.process_count()
    st.heartbeat_timeout = float(heartbeat_timeout)
    st.shutdown_timeout = float(shutdown_timeout)
    st.running = True
    st.stopping = False
    st.thread = threading.Thread(target=_watch, name='multihost-watchdog',
                                 daemon=True)
    st.thread.start()
  # Registered after `import jax`, so it runs before JAX's own atexit
  # shutdown of the distributed client.
  atexit.register(_at_exit)
  logging.info('%s multihost failure watchdog started: a killed '
               'peer is reported within about %.1f s.',
               _diagnostics.prefix(st.me), detection_bound())
  return True


def ensure_started() -> bool:
  """Starts the watchdog with JAX's default timeouts if nobody did."""
  if _state.running:
    return True
  return start(heartbeat_timeout=100.0)


def failed_processes() -> tuple[int, ...]:
  """Processes the watchdog has seen fail or exit, in index order."""
  with _state.cond:
    return tuple(sorted(set(_state.failed) | _state.exited))


def check(op: str) -> None:
  """Raises `ProcessFailureError` if a peer is already known to be gone."""
  if _state.failed or _state.exited or _state.service_lost:
    raise failure_error(op, waited=None)


def call(op: str, fn: Callable[..., Any], *args: Any,
         timeout: float | None = None) -> Any:
  """Runs `fn(*args)`, a blocking step of collective `op`, watched for failures.

  Without a running watchdog (one process, or recoverability off) `fn`
  still runs on the worker thread when there is a `timeout`, so the timeout
  holds on every path; with neither it is just `fn(*args)`.

  Args:
    op: the collective's name, for error messages.
    fn: the blocking step (a coordination-service wait or a device
      collective); it runs in a worker thread.
    *args: its arguments.
    timeout: seconds after which to give up on `fn` (None: never; use it for
      steps with no timeout of their own, such as gloo collectives).

  Returns:
    What `fn` returns.

  Raises:
    ProcessFailureError: a peer failed (named) before `fn` completed, or
      `fn` failed because a peer's connection dropped.
    CollectiveTimeoutError: `fn` did not complete within `timeout`.
    Whatever `fn` raises, otherwise.
  """
  st = _state
  if not st.running and not ensure_started():
    if timeout is None:
      return fn(*args)
    st.me = jax.process_index()  # Named in the timeout error.
  else:
    check(op)
  job = _Job(fn, args)
  worker = st.worker
  if worker is None:
    worker = st.worker = _Worker()
  start_time = time.monotonic()
  # The job's lock is released by the worker when `fn` returns, or by the
  # watchdog when a peer is gone; set membership is atomic under the GIL.
  st.pending.add(job)
  try:
    worker.submit(job)
    if not (st.failed or st.exited or st.service_lost):
      job.wake.acquire(timeout=-1 if timeout is None else max(timeout, 0))
  finally:
    st.pending.discard(job)
  if not job.done:
    st.worker = None  # It is stuck in `fn`; later calls get a new one.
    st.abandoned = True
    st.abandoned_jobs.append(job)
  waited = time.monotonic() - start_time
  if not job.done:
    if st.failed or st.exited or st.service_lost:
      raise failure_error(op, waited=waited)
    raise _diagnostics.step_timeout(op, me=st.me, waited=waited,
                                    timeout=timeout)
  if job.error is not None:
    if _is_peer_loss(job.error):
      _wait_for_named_failure()
      raise failure_error(op, waited=time.monotonic() - start_time,
                           cause=job.error) from job.error
    raise job.error
  return job.result


class _Job:
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
    except RuntimeError:  # Already released by the worker or the watchdog.
      pass


class _Worker:
  """A daemon thread that runs jobs one at a time."""

  def __init__(self):
    self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
    threading.Thread(target=self._run, name='multihost-collective',
                     daemon=True).start()

  def submit(self, job: _Job) -> None:
    self._jobs.put(job)

  def _run(self) -> None:
    while True:
      job = self._jobs.get()
      try:
        job.result = job.fn(*job.args)
      except BaseException as e:  # noqa: BLE001  Re-raised by the caller.
        job.error = e
      job.done = True
      job.notify()


def _is_peer_loss(error: BaseException) -> bool:
  message = str(error)
  return any(m in message for m in _PEER_LOSS_MARKERS)


def _wait_for_named_failure() -> None:
  """After a dropped connection, waits (bounded) for the watchdog to name it."""
  deadline = time.monotonic() + detection_bound()
  with _state.cond:
    while not (_state.failed or _state.exited or _state.service_lost):
      remaining = deadline - time.monotonic()
      if remaining <= 0 or not _state.running:
        return
      _state.cond.wait(remaining)


def failure_error(op: str, *, waited: float | None,
                  cause: BaseException | None = None
                  ) -> _errors.ProcessFailureError:
  """A `ProcessFailureError` for `op` naming the processes known gone."""
  st = _state
  with st.cond:
    failed = sorted(st.failed)
    exited = sorted(st.exited - set(st.failed))
    service_lost = st.service_lost
  return _diagnostics.process_failure(
      op, me=st.me, failed=failed, exited=exited, service_lost=service_lost,
      waited=waited, bound=detection_bound(), cause=cause)


def known_failure(op: str, *, waited: float,
                  cause: BaseException | None = None
                  ) -> _errors.ProcessFailureError | None:
  """`failure_error(...)` if the watchdog has seen a peer fail or exit, else None."""
  if not (_state.failed or _state.exited):
    return None
  return failure_error(op, waited=waited, cause=cause)


def failed_within_bound() -> tuple[int, ...]:
  """After a broken connection: the processes gone, once the watchdog names them.

  Waits up to `detection_bound()` (not at all without a running watchdog);
  may return () if nobody is named by then.
  """
  deadline = time.monotonic() + (detection_bound() if _state.running else 0.0)
  while not failed_processes() and time.monotonic() < deadline:
    time.sleep(0.05)
  return failed_processes()


def _wake_waiters() -> None:
  """Called with `cond` held after recording a failure."""
  _state.cond.notify_all()
  for job in list(_state.pending):
    job.notify()


def _watch() -> None:
  st = _state
  everyone = list(range(st.count))
  unreachable_since = None  # First failed liveness query of a streak.
  while not st.stopping:
    try:
      alive = set(_coordination.live_processes(everyone))
      unreachable_since = None
    except Exception as e:  # The service is unreachable.  # noqa: BLE001
      if st.stopping or _coordination.client() is None:
        return  # Exiting, or the program shut jax.distributed down itself.
      # A blip (a link down for less than the heartbeat timeout) is no
      # failure: retry up to the heartbeat bound before giving up for good.
      now = time.monotonic()
      unreachable_since = unreachable_since or now
      if now - unreachable_since < st.heartbeat_timeout:
        time.sleep(POLL_INTERVAL_S)
        continue
      with st.cond:
        st.service_lost = True
        _wake_waiters()
      logging.error('%s multihost watchdog: the coordination '
                    'service is unreachable (%s).', _diagnostics.prefix(st.me),
                    _diagnostics.shorten(e, 300))
      return
    gone = [p for p in everyone if p not in alive and p not in st.failed
            and p not in st.exited]
    if gone:
      exited = set(_exited_processes())
      now = time.monotonic()
      with st.cond:
        for p in gone:
          if p in exited:
            st.exited.add(p)
          else:
            st.failed[p] = now
        _wake_waiters()
      dead = [p for p in gone if p not in exited]
      if dead:
        logging.error('%s multihost watchdog: process(es) %s '
                      'failed (no heartbeat for %.0f s). Every collective '
                      'now raises ProcessFailureError.',
                      _diagnostics.prefix(st.me), dead,
                      st.heartbeat_timeout)
    time.sleep(POLL_INTERVAL_S)


def _exited_processes() -> list[int]:
  try:
    return [int(k.rsplit('/', 1)[1]) for k, _ in
            _coordination.kv_dir(_EXIT_DIR)]
  except Exception:  # noqa: BLE001
    return []


def _at_exit() -> None:
  """Leaves the job cleanly: records the exit; process 0 waits for the others.

  With recoverability on, JAX's shutdown barrier no longer holds process 0
  back, and when process 0 exits the coordination service goes with it and
  the C++ client aborts every process still connected. So every other
  process records its exit and disconnects at once, and process 0 waits (up
  to `shutdown_timeout`) until the watchdog has seen every other process
  leave or fail.

  No thread of ours may still be inside a C++ call when the interpreter
  finalizes: a daemon thread that returns from C++ then is unwound by force,
  which aborts the process. Disconnecting ends the coordination-service
  calls, and peers that leave end a gloo collective; if a thread is still
  inside one a few seconds later, the process leaves with `os._exit(1)`.
  """
  st = _state
  if not st.running or _coordination.client() is None:
    return
  try:
    hosting = _coordination.hosts_service() or _companion.is_host()
    if hosting:
      _coordination.kv_set(f'{_EXIT_DIR}{st.me}', b'')
      _wait_for_others_to_leave()
      _stop_watchdog()
    else:
      _stop_watchdog()
      _coordination.kv_set(f'{_EXIT_DIR}{st.me}', b'')
    if not hosting or st.abandoned or st.thread.is_alive():
      # Disconnect now: before process 0 goes, and to end our calls in
      # flight. (Otherwise JAX's own atexit does it.)
      jax.distributed.shutdown()
  except Exception as e:  # Never turn an exit into a hang.  # noqa: BLE001
    logging.warning('%s multihost: exit handshake failed: %s',
                    _diagnostics.prefix(st.me), _diagnostics.shorten(e, 300))
  st.stopping = True
  st.running = False
  deadline = time.monotonic() + _EXIT_GRACE_S
  st.thread.join(max(0.0, deadline - time.monotonic()))
  for job in list(st.abandoned_jobs):
    while not job.done and time.monotonic() < deadline:
      time.sleep(0.01)
  if st.thread.is_alive() or not all(j.done for j in st.abandoned_jobs):
    logging.error('%s multihost: leaving with os._exit(1): a '
                  'collective abandoned after a peer failed is still running '
                  'in C++, and a normal exit would abort or hang on it.',
                  _diagnostics.prefix(st.me))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _stop_watchdog() -> None:
  """Stops the watchdog; it finishes its current liveness query first."""
  st = _state
  st.stopping = True
  if st.thread is not None:
    st.thread.join(POLL_INTERVAL_S + 3.0)


def _wait_for_others_to_leave() -> None:
  st = _state
  deadline = time.monotonic() + st.shutdown_timeout
  others = set(range(st.count)) - {st.me}
  with st.cond:
    while True:
      left = st.exited | set(st.failed)
      if others <= left or st.service_lost or not st.thread.is_alive():
        return
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        break
      st.cond.wait(min(remaining, POLL_INTERVAL_S))
  logging.warning('%s multihost: exiting after %.0f s although '
                  'process(es) %s have not exited; the JAX runtime will abort '
                  'them when the coordination service stops with this '
                  'process.', _diagnostics.prefix(st.me), st.shutdown_timeout,
                  sorted(others - left))
