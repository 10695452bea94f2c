"""`Controllers`: N controllers of one command as a context manager, supervised together and restarted.

Composes the parts: the controllers' environment (`_environment`), what
the run holds from start to stop (`_resources`: hosts, port, cache folder,
optionally the coordination service it hosts), one attempt's steps
(`_attempt`), the processes (`_processes`), the run policy and restarts
(`_policy`), signal forwarding (`_signals`) and the report (`_report`,
`_restarts`).
"""

from __future__ import annotations

import atexit
import collections.abc
import os
import signal
import time
from typing import TextIO
import weakref

from multihost import env as env_lib
from multihost._src.diagnostics import gloo_lines as _gloo_lines
from multihost.launch._src.policy import policy as _policy
from multihost.launch._src.policy import restarts as _restarts
from multihost.launch._src.processes import environment as _environment
from multihost.launch._src.processes import processes as _processes
from multihost.launch._src.processes import signals as _signals
from multihost.launch._src.report import report as _report
from multihost.launch._src.run import attempt as _attempt
from multihost.launch._src.run import resources as _resources

DEFAULT_HEARTBEAT_S = float(env_lib.DEFAULT_HEARTBEAT_S)


# Live clusters, killed at interpreter exit if their owner did not stop them.
_LIVE: weakref.WeakSet[Controllers] = weakref.WeakSet()


@atexit.register
def _stop_all_live() -> None:
  for cluster in list(_LIVE):
    cluster.stop()


class Controllers:
  """N controllers of one command on this machine, supervised together.

  Use as a context manager: on exit every process still running is stopped
  (SIGTERM, then SIGKILL), whatever happened. `wait()` applies the run's
  policy (first failure stops the others: at once when a restart follows,
  else after a grace period; timeout; restarts); tests that inject failures
  use `pids`, `kill()` and `wait_for_output()`, which concern the current
  attempt.

  Each process runs in its own session (process group), so a Ctrl-C on the
  terminal reaches only the launcher, which forwards it; stopping a process
  signals its group, which holds only that process and its descendants.

  Args:
    command: the program and its arguments, run by every process.
    num_processes: number of controllers.
    devices_per_process: CPU devices per controller.
    env: extra environment variables for every process (over os.environ).
    cwd: working directory of the processes.
    grace_period: seconds the others get to finish after the first failure
      (math.inf: never stop them) when no restart follows it. When one does
      (restarts are left), the others are stopped at once: SIGTERM, then
      SIGKILL after at most 0.5 s (`_policy.RESTART_KILL_WAIT_S`).
    stream: where to write the prefixed output lines live (None: only
      capture them).
    kill_wait: seconds between SIGTERM and SIGKILL when stopping.
    port: the coordinator port (default: a free one, fresh each attempt).
    host_service: host JAX's coordination service in this (launcher)
      process instead of in process 0's companion process (either way the
      death of process 0 is an ordinary failure the others raise
      `ProcessFailureError` for). The controllers must call
      `multihost.initialize()` (not a bare `jax.distributed.initialize()`).
    heartbeat_timeout: with host_service, seconds without heartbeats before
      the service declares a controller dead.
    hosts: None (every controller on this machine's loopback) or 'netns':
      each controller on a simulated host of its own (`multihost.netns`,
      one network namespace each, needs root and `ip`), the coordinator at
      host 0's address; `self.hosts` is then the running
      `multihost.netns.SimulatedHosts`, e.g. `cluster.hosts.cut(1)`.
      The hosts are deleted when the controllers stop.
    max_restarts: after a failed attempt (any controller failed; the others
      were stopped), start all of them again, up to this many times
      (torchrun's `--max-restarts`). Each controller gets its attempt's
      number in `MULTIHOST_RESTART_COUNT` (0 first). A success, an
      interrupt, the timeout, or a controller that exited with
      `multihost.env.NO_RETRY_EXIT_STATUS` (78: restarting will not help)
      ends the run.
    compilation_cache_dir: JAX's persistent compilation cache folder
      (`JAX_COMPILATION_CACHE_DIR`) for every attempt, created if missing and
      kept. None: the `JAX_COMPILATION_CACHE_DIR` of `env` or of this
      process's environment if set (even empty), else, with `max_restarts`,
      a fresh folder under the temp folder (`multihost-jax-cache-*`), the
      same for every attempt, removed when the controllers stop; without
      restarts, none. `self.compilation_cache_dir` is the one in use.
    log_dir: where a failed attempt that is restarted leaves every line of
      each process: in a folder of this run's own made there at the first
      restart (`run-<UTC time>-<random>/attempt-K.pI.log`, so that runs
      that share `log_dir` never overwrite each other's; it is
      `self.run_log_dir`), created if missing and kept. While
      restarts are left, the lines of Python tracebacks are held back from
      `stream` (and, once the attempt failed, every line of the processes
      being stopped); a restart drops them (they are in the files) and
      says in one block what failed, where the others were and where the
      files are; a failure that ends the run streams them after all, so its
      traceback shows once. None: a fresh `multihost-launch-logs-*` folder
      under the temp folder, made at the first restart.
    hold_tracebacks: False streams every line live (nothing held).
  """

  def __init__(self, command: collections.abc.Sequence[str], *,
               num_processes: int, devices_per_process: int = 1,
               env: collections.abc.Mapping[str, str] | None = None,
               cwd: str | os.PathLike[str] | None = None,
               grace_period: float = _policy.DEFAULT_GRACE_PERIOD_S,
               stream: TextIO | None = None,
               kill_wait: float = _policy.DEFAULT_KILL_WAIT_S,
               port: int | None = None,
               host_service: bool = False,
               heartbeat_timeout: float = DEFAULT_HEARTBEAT_S,
               hosts: str | None = None,
               max_restarts: int = 0,
               compilation_cache_dir: str | os.PathLike[str] | None = None,
               log_dir: str | os.PathLike[str] | None = None,
               hold_tracebacks: bool = True):
    _environment.check_hosts(hosts, host_service=host_service)
    _environment.check_command(command, num_processes=num_processes,
                               devices_per_process=devices_per_process)
    _policy.check(grace_period=grace_period, kill_wait=kill_wait,
                  max_restarts=max_restarts)
    self.command = [os.fspath(c) for c in command]
    self.num_processes = num_processes
    self.devices_per_process = devices_per_process
    self.grace_period = grace_period
    self.kill_wait = kill_wait
    self.host_service = host_service
    self.heartbeat_timeout = heartbeat_timeout
    self.max_restarts = max_restarts
    self.restart_count = 0  # Of the current attempt.
    self.hosts_kind = hosts
    self._extra_env = dict(env or {})
    self._held = _resources.Resources(
        num_processes=num_processes, port=port, hosts_kind=hosts,
        host_service=host_service, heartbeat_timeout=heartbeat_timeout,
        cache_choice=(None if compilation_cache_dir is None
                      else os.fspath(compilation_cache_dir)),
        extra_env=self._extra_env)
    self._cwd = cwd
    self._stream = stream
    # $MULTIHOST_QUIET_GLOO of the controllers' environment.
    self._quiet_gloo = _gloo_lines.wanted({**os.environ, **self._extra_env})
    self._procs = _processes.Processes(num_processes, stream=stream,
                                       quiet_gloo=self._quiet_gloo)
    self._started = False
    self._start_time = time.monotonic()
    self._attempt_starts: list[float] = []
    self._interrupts = _signals.Interrupts()
    self._result: _report.LaunchResult | None = None
    self.log_dir = None if log_dir is None else os.fspath(log_dir)
    self.run_log_dir: str | None = None  # Made at the first restart.
    self._hold = hold_tracebacks and stream is not None

  # Starting and observing.

  def start(self) -> Controllers:
    """Starts every process; returns self."""
    if self._started:
      raise RuntimeError('These controllers were already started.')
    self._started = True
    self._start_time = time.monotonic()
    _LIVE.add(self)
    try:
      self._held.open(max_restarts=self.max_restarts)
      self._spawn_attempt()
    except BaseException:
      self.stop()
      raise
    return self

  def _spawn_attempt(self) -> None:
    """Starts attempt `restart_count`: a coordinator port, the service if hosted, every process."""
    port = self._held.next_port()
    if self.restart_count:
      self._procs = _processes.Processes(self.num_processes,
                                         stream=self._stream,
                                         quiet_gloo=self._quiet_gloo)
    if self._hold and _policy.restarts_left(restart_count=self.restart_count,
                                            max_restarts=self.max_restarts):
      self._procs.output.hold_tracebacks()
    self._procs.start_time = time.monotonic()
    self._attempt_starts.append(self._procs.start_time - self._start_time)
    address, command = _attempt.commands(self.command, self.num_processes,
                                         self.hosts)
    service_env = self._held.service_env()
    envs = _attempt.environments(
        num_processes=self.num_processes,
        devices_per_process=self.devices_per_process, port=port,
        address=address, service_env=service_env, extra_env=self._extra_env,
        compilation_cache_dir=self.compilation_cache_dir,
        restart_count=self.restart_count)
    for i in range(self.num_processes):
      self._procs.spawn(command[i], env=envs[i], cwd=self._cwd)

  @property
  def port(self) -> int | None:
    """The current attempt's coordinator port."""
    return self._held.port

  @property
  def hosts(self):
    """The running `multihost.netns.SimulatedHosts` with hosts='netns', else None."""
    return self._held.hosts

  @property
  def compilation_cache_dir(self) -> str | None:
    """The compilation cache folder the attempts get (None: none set here)."""
    return self._held.compilation_cache_dir

  @property
  def pids(self) -> list[int]:
    return self._procs.pids

  @property
  def returncodes(self) -> list[int | None]:
    """Per process: None while running, else as `subprocess` reports it."""
    return self._procs.returncodes()

  @property
  def outputs(self) -> list[str]:
    """Per process: its merged stdout/stderr so far, without prefixes."""
    return [self.output(i) for i in range(self.num_processes)]

  def output(self, index: int) -> str:
    return self._procs.output.text(index)

  def running(self) -> list[int]:
    """Indices of the processes that have not exited."""
    return self._procs.running()

  @property
  def run_start(self) -> float:
    """When the run started (time.monotonic())."""
    return self._start_time

  @property
  def attempt_starts(self) -> list[float]:
    """Seconds from the run's start to each attempt's."""
    return list(self._attempt_starts)

  def elapsed(self) -> float:
    """Seconds since `start()` (of all attempts together)."""
    return time.monotonic() - self._start_time

  def wait_for_output(self, index: int, text: str, *,
                      timeout: float) -> bool:
    """Waits until process `index` prints `text`; False on timeout or exit."""
    return self._procs.wait_for_output(index, text, timeout=timeout)

  def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
    """Sends `sig` to process `index` (its pid only) if it is running."""
    self._procs.kill(index, sig)

  # Waiting, with the run's policy.

  def wait(self, timeout: float | None = None) -> _report.LaunchResult:
    """Waits for the run to end, enforcing its policy, and stops the rest.

    When the first process fails (non-zero status or a signal) and
    `max_restarts` restarts are left, the others are stopped at once and
    every process starts again (`_policy.after_attempt`); when none are left
    (or the failed process exited with `NO_RETRY_EXIT_STATUS`: restarting
    will not help), the others get the grace period, then are stopped, and
    the run ends. At `timeout` seconds from the start, every process still
    running is stopped. Nothing is running when this returns.

    Args:
      timeout: seconds for the whole run (all attempts), counted from
        `start()`; None waits without limit.

    Returns:
      The `LaunchResult` (of the last attempt, with every attempt in
      `attempts`); the same one again on later calls.
    """
    if self._result is not None:  # The run ended already.
      return self._result
    if not self._started:
      self.start()
    attempts = []
    try:
      while True:
        left = None if timeout is None else max(0.0, timeout - self.elapsed())
        attempt = self._wait_attempt(left)
        attempts.append(attempt)
        no_retry = _restarts.not_retried(attempt)
        then = _policy.after_attempt(
            exit_code=attempt.exit_code, timed_out=attempt.timed_out,
            interrupted=attempt.interrupted_by is not None,
            restart_count=self.restart_count, max_restarts=self.max_restarts,
            time_left=None if timeout is None else timeout - self.elapsed(),
            no_retry=no_retry is not None)
        if then != _policy.RESTART:
          self._procs.output.release()  # The run ends: tell it all, once.
          if (no_retry is not None and attempt.interrupted_by is None and
              not attempt.timed_out and self.max_restarts):
            self._say(f'attempt {self.restart_count} failed: '
                      f'{_restarts.attempt_cause(attempt)}; {no_retry}.')
          break
        self.restart_count += 1
        self._say(f'attempt {self.restart_count - 1} failed: '
                  f'{_restarts.attempt_cause(attempt)}; restarting all '
                  f'{self.num_processes} (restart {self.restart_count} of '
                  f'{self.max_restarts}).')
        self._say_healed(attempt, self.restart_count - 1)
        self._spawn_attempt()
    finally:
      self.stop()
    self._result = _restarts.combine(
        attempts, starts=self._attempt_starts[:len(attempts)],
        max_restarts=self.max_restarts, elapsed=self.elapsed())
    return self._result

  def _wait_attempt(self, timeout: float | None) -> _report.LaunchResult:
    """Supervises the current attempt to its end (`timeout` seconds from now at most); stops its processes; returns its result."""
    step = _attempt.supervise(
        self._procs, timeout=timeout, grace_period=self.grace_period,
        kill_wait=self.kill_wait,
        restart_at_once=_policy.restarts_left(
            restart_count=self.restart_count, max_restarts=self.max_restarts),
        hold=self._hold, interrupts=self._interrupts,
        poll_signals=self._poll_signals, stop=self._stop_attempt)
    return _attempt.result(
        self._procs, step, devices_per_process=self.devices_per_process,
        grace_period=self.grace_period, host_service=self.host_service,
        interrupted_by=self._interrupts.first, hosts_kind=self.hosts_kind,
        host_addresses=(
            tuple(self.hosts.address(i) for i in range(self.num_processes))
            if self.hosts is not None else ()))

  def _say_healed(self, attempt: _report.LaunchResult, k: int) -> None:
    """Writes failed attempt `k`'s output to one file per process and says where the others were and where the files are."""
    held = self._procs.output.drop_held()
    self.run_log_dir = _attempt.tell_restarted(
        self._stream, attempt, k, held=held, log_dir=self.log_dir,
        run_log_dir=self.run_log_dir)

  def _say(self, text: str) -> None:
    """Writes a `[launcher] ` line to the live stream, if there is one."""
    _attempt.say(self._stream, text)

  def _poll_signals(self) -> int | None:
    """The stop signal the launcher got (or None); forwards where-report requests first."""
    if self._interrupts.take_reports():
      self.request_report()
    return self._interrupts.first

  def request_report(self) -> None:
    """Asks every running controller to print where it is (SIGUSR1 to its pid), without stopping it.

    A controller handles it once `multihost.initialize()` has run; one that
    does not handle SIGUSR1 (which would kill it) is skipped, and said so.
    """
    _attempt.ask_where(self._procs)

  def _stop_attempt(self, kill_wait: float | None = None) -> None:
    """Stops the current attempt's processes (SIGTERM, then SIGKILL after `kill_wait`, default self.kill_wait) and its hosted service."""
    _policy.stop(self._procs,
                 kill_wait=self.kill_wait if kill_wait is None else kill_wait)
    self._held.stop_service()

  def stop(self) -> None:
    """Stops every running process: SIGTERM, then SIGKILL after kill_wait; deletes the simulated hosts and the compilation cache folder made here."""
    self._stop_attempt()
    self._held.close()
    _LIVE.discard(self)

  # Context manager.

  def __enter__(self) -> Controllers:
    if not self._started:
      self.start()
    return self

  def __exit__(self, *exc_info) -> None:
    self.stop()

  def forward_signals(self) -> collections.abc.Callable[[], None]:
    """Makes SIGINT/SIGTERM/SIGHUP stop the run (main thread only); returns the undo function.

    The signal is forwarded to the running processes, which get the grace
    period to stop and are then killed; a second signal kills them at once.
    (Only a SIGKILL of the launcher itself can leave them running.)
    """
    return self._interrupts.install()

