"""Liveness: the watchdog, a thread per process that sees a peer die (liveness polling).

When a peer is killed, JAX does not tell the survivors in a way Python can
catch: with `jax_enable_recoverability` off, every survivor is aborted
(SIGABRT) at the heartbeat timeout; with it on, nothing is aborted, but a
coordination-service barrier waits for the dead process until its own
timeout, and a gloo device collective waits forever on every process that is
not a ring neighbour of the dead one (neighbours get "Connection closed by
peer" at once). See docs/failures.md.

So, with recoverability on (`multihost.initialize()` turns it on):

* A daemon thread per process (the watchdog) asks the coordination service
  which processes are alive, every `POLL_INTERVAL_S`. The service drops a
  process when its heartbeats stop for `heartbeat_timeout` seconds, so a
  failure is seen within about heartbeat_timeout + POLL_INTERVAL_S.
* Every blocking step of a collective runs through `liveness.blocking.call`, which
  wakes when the watchdog sees a peer gone and raises `ProcessFailureError`
  naming it, even if the step is stuck in C++.
* Once a failure is known, every later collective raises at once (`check`).
* At exit, the handshake of `liveness.exit_handshake` uses what the watchdog saw: a peer that
  exits normally is reported as "exited", not "failed", and process 0 waits
  for the others to leave before it takes the service down with it.
* When it sees a peer fail, it starts the policy of `liveness.peer_loss_exit`
  (`peer_loss`): unless a `ProcessFailureError` reaches the program within
  the grace period (every error made here counts as delivered), the process
  logs where its main thread is and leaves with exit status 75, because it
  is stuck in a call Python cannot interrupt (a jitted step's collective).
  `set_exit_on_peer_failure` and $MULTIHOST_EXIT_ON_PEER_FAILURE set it.

The watchdog is one object (`Watchdog`, the runtime's `watchdog`) whose
state is private: the watched calls (`liveness.blocking.Calls`) and the exit
handshake use its methods, and other packages call its methods and read
what it knows as an immutable `Snapshot` (`snapshot()`).

Process 0 is special when it hosts the coordination service (JAX's
default): when it dies, the C++ client of every other process aborts the
process (SIGABRT, "Terminating process because the JAX distributed service
detected fatal errors") about 1 ms after the connection drops, before any
Python code can run; a Python `missed_heartbeat_callback` cannot replace that
abort in jaxlib 0.10.2 (its status argument fails to convert: std::bad_cast,
then std::terminate). The launcher reports it (process 0 died first). When a
launcher hosts the service instead (`runtime.coordination.start_service` and
$MULTIHOST_EXTERNAL_SERVICE=1), or process 0's companion does (the default,
`runtime.companion`), process 0's death is an ordinary failure.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Collection
import dataclasses
import os
import sys
import threading
import time
import traceback
from typing import Any
from typing import NoReturn

from multihost._src.liveness import blocking
from multihost._src.liveness import exit_handshake
from multihost._src.liveness import peer_loss_exit
from multihost._src.runtime import coordination
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import runtime as _runtime
from multihost._src.runtime import settings as _settings

POLL_INTERVAL_S = 0.5
DEFAULT_HEARTBEAT_S = 100.0  # JAX's default heartbeat_timeout_seconds
# Beyond the heartbeat timeout: up to two polls (one in flight when the
# service drops the process, the next that sees it) and a second for the
# service's own heartbeat check.
DETECTION_SLACK_S = 2 * POLL_INTERVAL_S + 1.0
# How often the process running the service looks again while it waits at
# exit for the others.
_LOOK_S = 0.5


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """What one process's watchdog knows about the other processes at one moment (immutable; `Watchdog.snapshot()`).

  Attributes:
    me: this process's index.
    count: how many processes the job has.
    failed: the processes seen to fail (their heartbeats stopped).
    exited: the processes that recorded their exit and left.
    exited_normally: of `exited`, those that left normally (not after an
      error).
    service_lost: whether the coordination service became unreachable.
    watching: whether the watchdog runs (started, and not stopped by the
      exit sequence).
  """

  me: int
  count: int
  failed: frozenset[int]
  exited: frozenset[int]
  exited_normally: frozenset[int]
  service_lost: bool
  watching: bool

  def gone(self) -> frozenset[int]:
    """The processes known gone: failed or exited."""
    return self.failed | self.exited

  def still_here(self) -> list[int]:
    """The other processes not known gone, in index order."""
    return sorted(set(range(self.count)) - {self.me} - self.gone())


class Watchdog:
  """This process's liveness: watches its peers, runs watched calls, leaves the job, and leaves by itself when stuck.

  Other packages use its methods and read its `snapshot()`; its state is
  its own (guarded by `_cond`). The watched calls (`liveness.blocking`) and
  the exit handshake (`liveness.exit_handshake`) are its parts, behind the
  methods they call.
  """

  def __init__(self, runtime: _runtime.Runtime, *,
               describe: Callable[[], str] | None = None):
    self._runtime = runtime
    self._cond = threading.Condition()
    self._running = False
    self._stopping = False
    self._me = 0
    self._count = 1
    self._heartbeat_timeout = DEFAULT_HEARTBEAT_S
    self._shutdown_timeout = 300.0
    self._failed: dict[int, float] = {}  # process -> time.monotonic() seen.
    self._exited: set[int] = set()
    self._exited_normally: set[int] = set()  # Of `exited`: not after an error.
    self._service_lost = False
    self._thread: threading.Thread | None = None
    # The watched calls: the step thread, the steps whose callers wait
    # (woken here), the steps abandoned in C++ (awaited at exit) and the
    # op of the last one that failed (read by the exit handshake).
    self._calls = blocking.Calls()
    # Leaving after a peer failure (see `liveness.peer_loss_exit`), and what renders
    # this process's main thread for its last line: `diagnostics.where` sets a
    # where-report; until then, a plain stack.
    self._peer_loss = peer_loss_exit.PeerLossExit(exit_fn=self.leave)
    configure_peer_loss(self._peer_loss, runtime.settings)
    self._describe: Callable[[], str] = describe or _main_thread_stack

  def leave(self, status: int) -> NoReturn:
    """Leaves with `status` at once, after the exit sequence's trace dump (a local file).

    How this process leaves by itself: after a peer's failure
    (`liveness.peer_loss_exit`) and after a stuck step
    (`liveness.step_deadline`).
    """
    dump = self._runtime.exit_steps.pop('trace', None)
    if dump is not None:
      try:
        dump()
      except Exception:  # noqa: BLE001  Leaving matters more.
        pass
    os._exit(status)

  def snapshot(self) -> Snapshot:
    """What it knows now about the other processes (a consistent, immutable copy)."""
    with self._cond:
      return Snapshot(
          me=self._me, count=self._count, failed=frozenset(self._failed),
          exited=frozenset(self._exited),
          exited_normally=frozenset(self._exited_normally),
          service_lost=self._service_lost, watching=self._running)

  def watching(self) -> bool:
    """Whether it runs (started, and not stopped by the exit sequence)."""
    return bool(self._running)

  def failure_delivered(self) -> None:
    """Says that a `ProcessFailureError` reached the program: the peer-loss exit need not leave for it (`liveness.peer_loss_exit`)."""
    self._peer_loss.delivered()

  def configure_peer_loss(self, *, enabled: bool, grace: float | None = None,
                          before_exit: Callable[[list[int]], None] | None
                          = None) -> float:
    """Sets the leave-on-peer-failure policy (`set_exit_on_peer_failure`); returns its grace in seconds.

    Raises:
      ValueError: `grace` is negative.
      TypeError: `before_exit` is not callable.
    """
    self._peer_loss.configure(enabled=enabled, grace=grace,
                              before_exit=before_exit)
    return self._peer_loss.grace

  def use_peer_loss(self, policy: peer_loss_exit.PeerLossExit) -> None:
    """Runs `policy` instead when it sees a peer fail (one that exits through a function of its own, in tests)."""
    self._peer_loss = policy

  def cancel_peer_loss(self) -> None:
    """Never leaves by itself after a peer failure from now on (the process is leaving anyway)."""
    self._peer_loss.cancel()

  def set_shutdown_timeout(self, seconds: float) -> None:
    """Sets how long the process running the service waits at exit for the others (`liveness.exit_handshake`)."""
    self._shutdown_timeout = float(seconds)

  def shutdown_timeout(self) -> float:
    """How long the process running the service waits at exit for the others, in seconds."""
    return self._shutdown_timeout

  def gone(self) -> bool:
    """Whether a peer (or the service) is known to be gone."""
    return bool(self._failed or self._exited or self._service_lost)

  def only_normal_exits(self) -> bool:
    """Whether every peer known gone left normally (none failed, none left after an error)."""
    return not (self._failed or self._service_lost) and (
        self._exited <= self._exited_normally)

  def detection_bound(self) -> float:
    """Seconds within which the watchdog reports a peer that was killed.

    docs/failures.md gives it as heartbeat timeout + DETECTION_SLACK_S.
    """
    return self._heartbeat_timeout + DETECTION_SLACK_S

  def start(self, *, heartbeat_timeout: float,
            shutdown_timeout: float = 300.0) -> bool:
    """Starts the watchdog (once); returns whether it runs.

    It runs only with more than one process, a coordination client and
    recoverability on (without it, JAX aborts the survivors itself). Every
    process must start it: asking the service which processes are alive is
    a rendezvous of all live processes.

    Args:
      heartbeat_timeout: the `heartbeat_timeout_seconds` given to
        `jax.distributed.initialize` (bounds the detection time).
      shutdown_timeout: how long process 0 waits at exit for the others.
    """
    rt = self._runtime
    with self._cond:
      if self._running:
        return True
      if (self._stopping  # After the exit handshake: never start again.
          or rt.client is None or rt.count == 1 or not rt.recoverable):
        return False
      self._me = rt.index
      self._count = rt.count
      self._heartbeat_timeout = float(heartbeat_timeout)
      self._shutdown_timeout = float(shutdown_timeout)
      self._running = True
      self._thread = threading.Thread(target=self._poll, args=(rt.client,),
                                      name='multihost-watchdog', daemon=True)
      self._thread.start()
    rt.exit_steps['handshake'] = lambda: exit_handshake.leave(rt)
    if rt.raw is not None:  # The process's own runtime, not a test's.
      exit_handshake.note_uncaught_exceptions()
    rt.log.info('multihost failure watchdog started: a killed peer is '
                'reported within %.1f s (heartbeat timeout %g s + %g s).',
                self.detection_bound(), self._heartbeat_timeout,
                DETECTION_SLACK_S)
    return True

  def ensure_started(self) -> bool:
    """Starts the watchdog with JAX's default timeouts if nobody did."""
    return self._running or self.start(heartbeat_timeout=DEFAULT_HEARTBEAT_S)

  def call(self, op: str, fn: Callable[..., blocking.T], *args: Any,
           timeout: float | None = None,
           met_elsewhere: bool = False) -> blocking.T:
    """Runs `fn(*args)`, a blocking step of collective `op`, watched for failures (see `liveness.blocking.call`)."""
    if not self._running and not self.ensure_started():
      if timeout is None:
        return fn(*args)
      self._me = self._runtime.index  # Named in the timeout error.
    elif not (met_elsewhere and self.only_normal_exits()):
      self.check(op)
    return self._calls.run(op, fn, args, watcher=self, me=self._me,
                           timeout=timeout,
                           source=self._runtime.timeout_source)

  def last_step_failed(self) -> str | None:
    """The op of the last watched step that raised a timeout or a failure here (None once a later one completed)."""
    return self._calls.failed_op()

  def failed_processes(self) -> tuple[int, ...]:
    """Processes the watchdog has seen fail or exit, in index order."""
    with self._cond:
      return tuple(sorted(set(self._failed) | self._exited))

  def check(self, op: str) -> None:
    """Raises `ProcessFailureError` if a peer is already known to be gone."""
    if self._failed or self._exited or self._service_lost:
      raise self.failure_error(op, waited=None)

  def failure_error(self, op: str, *, waited: float | None,
                    cause: BaseException | None = None
                    ) -> errors.ProcessFailureError:
    """A `ProcessFailureError` for `op` naming the processes known gone."""
    with self._cond:
      failed = sorted(self._failed)
      exited = sorted(self._exited - set(self._failed))
      service_lost = self._service_lost
    # Every caller raises it to the program, which then has control: this
    # process need not leave by itself.
    self._peer_loss.delivered()
    return failures.process_failure(
        op, me=self._me, failed=failed, exited=exited,
        service_lost=service_lost, waited=waited,
        bound=self.detection_bound(), cause=cause)

  def known_failure(self, op: str, *, waited: float,
                    cause: BaseException | None = None
                    ) -> errors.ProcessFailureError | None:
    """`failure_error(...)` if the watchdog has seen a peer fail or exit, else None."""
    if not (self._failed or self._exited):
      return None
    return self.failure_error(op, waited=waited, cause=cause)

  def wait_for_named_failure(self) -> None:
    """After a dropped connection, waits (bounded) for the watchdog to name it."""
    deadline = time.monotonic() + self.detection_bound()
    with self._cond:
      while not self.gone():
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self._running:
          return
        self._cond.wait(remaining)

  def failed_within_bound(self, until: float | None = None
                          ) -> tuple[int, ...]:
    """After a broken connection: the processes gone, once the watchdog names them.

    Waits up to `detection_bound()` (not at all without a running watchdog),
    and not past `until` (time.monotonic()) if given; may return () if
    nobody is named by then.
    """
    deadline = time.monotonic() + (
        self.detection_bound() if self._running else 0.0)
    if until is not None:
      deadline = min(deadline, until)
    while not self.failed_processes() and time.monotonic() < deadline:
      time.sleep(0.05)
    failed = self.failed_processes()
    if failed:  # The callers raise a ProcessFailureError naming them.
      self._peer_loss.delivered()
    return failed

  def wait_for_others_to_leave(self, timeout: float, *,
                               but: Collection[int] = ()) -> list[int]:
    """Waits up to `timeout` s until every other process (except `but`) left or failed; returns those still there.

    Returns [] as soon as the service is lost or the watchdog stopped
    polling (nothing more will be seen).
    """
    deadline = time.monotonic() + timeout
    others = set(range(self._count)) - {self._me} - set(but)
    with self._cond:
      while True:
        left = self._exited | set(self._failed)
        if (others <= left or self._service_lost
            or not self._polls()):
          return []
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          return sorted(others - left)
        self._cond.wait(min(remaining, _LOOK_S))

  def in_flight(self) -> bool:
    """Whether a thread of its own may be inside a C++ call: its polling thread, or a watched step abandoned after a failure."""
    return self._calls.abandoned() or self._polls()

  def stop_polling(self, *, wait: bool = True) -> None:
    """Stops the watchdog; it finishes its current liveness query first (joined, bounded, if `wait`)."""
    self._stopping = True
    if wait and self._thread is not None:
      self._thread.join(POLL_INTERVAL_S + 3.0)

  def finish(self, deadline: float) -> bool:
    """Stops for good (the exit handshake's last step); waits until `deadline` (time.monotonic()) for its threads; returns whether they all ended.

    A step abandoned in C++ or the polling thread still running then would
    abort or hang the interpreter's exit.
    """
    self._stopping = True
    self._running = False
    if self._thread is not None:
      self._thread.join(max(0.0, deadline - time.monotonic()))
    ended = self._calls.wait_for_abandoned(deadline)
    return ended and not self._polls()

  def _polls(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def _wake_waiters(self) -> None:
    """Called with `_cond` held after recording a failure."""
    self._cond.notify_all()
    self._calls.wake()

  def _poll(self, client: coordination.Client) -> None:
    rt = self._runtime
    everyone = list(range(self._count))
    unreachable_since = None  # First failed liveness query of a streak.
    while not self._stopping:
      try:
        alive = set(client.live_processes(everyone))
        unreachable_since = None
      except Exception as e:  # The service is unreachable.  # noqa: BLE001
        if self._stopping or not rt.connected():
          return  # Exiting, or the program shut jax.distributed down itself.
        # A blip (a link down for less than the heartbeat timeout) is no
        # failure: retry up to the heartbeat bound before giving up for good.
        now = time.monotonic()
        unreachable_since = unreachable_since or now
        if now - unreachable_since < self._heartbeat_timeout:
          time.sleep(POLL_INTERVAL_S)
          continue
        with self._cond:
          self._service_lost = True
          self._wake_waiters()
        rt.log.error('multihost watchdog: the coordination service is '
                     'unreachable (%s).', failures.shorten(e, 300))
        return
      gone = [p for p in everyone if p not in alive and p not in self._failed
              and p not in self._exited]
      if gone:
        exited = exit_handshake.exited_processes(client)
        now = time.monotonic()
        with self._cond:
          for p in gone:
            if p in exited:
              if exited[p]:  # (First: `only_normal_exits` reads no lock.)
                self._exited_normally.add(p)
              self._exited.add(p)
            else:
              self._failed[p] = now
          self._wake_waiters()
        dead = [p for p in gone if p not in exited]
        if dead:
          rt.log.error('multihost watchdog: process(es) %s failed (no '
                       'heartbeat for %.0f s). Every collective now raises '
                       'ProcessFailureError.', dead, self._heartbeat_timeout)
          self._peer_loss.failure_seen(sorted(self._failed), prefix=rt.prefix,
                                       describe=self._describe)
      time.sleep(POLL_INTERVAL_S)


def _main_thread_stack() -> str:
  """The main thread's innermost frames on one line (without `diagnostics.where`)."""
  frames = sys._current_frames()  # pylint: disable=protected-access
  ident = threading.main_thread().ident
  frame = None if ident is None else frames.get(ident)
  if frame is None:
    return 'main thread: no Python frames'
  stack = traceback.extract_stack(frame)[-6:][::-1]
  return 'main thread in ' + ' <- '.join(
      f'{f.name} ({f.filename.rsplit("/", 1)[-1]}:{f.lineno})' for f in stack)


def configure_peer_loss(policy: peer_loss_exit.PeerLossExit,
                        settings: _settings.Settings) -> None:
  """Applies the program's setting, else $MULTIHOST_EXIT_ON_PEER_FAILURE, to `policy`."""
  enabled, grace, before_exit = settings.peer_loss()
  policy.configure(enabled=enabled, grace=grace, before_exit=before_exit)


def set_exit_on_peer_failure(
    enabled: bool = True, *, grace: float | None = None,
    before_exit: Callable[[list[int]], None] | None = None) -> None:
  """Sets whether this process leaves by itself, with exit status 75, when a peer fails while it cannot be told.

  When the failure watchdog sees a peer die and, within `grace` seconds, no
  multihost call raises `ProcessFailureError` here (the main thread is stuck
  in a call Python cannot interrupt, such as a jitted step's device
  collective waiting for the dead peer), the process runs `before_exit`,
  logs one line naming the failed processes and where its main thread is,
  flushes its logs and leaves with `os._exit(75)` (BSD's EX_TEMPFAIL), so
  that a launcher or a scheduler can restart the job. On by default (off
  with $MULTIHOST_EXIT_ON_PEER_FAILURE=0). Our own collectives raise
  `ProcessFailureError` as before, which cancels the exit.

  Args:
    enabled: whether to leave (False: stay, as a process without failure
      detection would).
    grace: seconds between seeing the failure and leaving (default 7; the
      failure is seen within the heartbeat timeout + 2 s of the death).
    before_exit: called with the list of failed process indices right before
      leaving, e.g. to write host-local state; it may run for up to 60 s.

  Raises:
    ValueError: `grace` is negative.
    TypeError: `before_exit` is not callable.
  """
  rt = _runtime.current()
  # Checked (and applied to the running watchdog) before it is kept.
  kept_grace = rt.watchdog.configure_peer_loss(
      enabled=enabled, grace=grace, before_exit=before_exit)
  rt.settings.exit_on_peer_failure = (bool(enabled), kept_grace, before_exit)


def detection_bound() -> float:
  """Seconds within which the watchdog reports a peer that was killed."""
  return _runtime.current().watchdog.detection_bound()


def failed_processes() -> tuple[int, ...]:
  """Processes the current runtime's watchdog has seen fail or exit."""
  return _runtime.current().watchdog.failed_processes()
