"""Runs N JAX controllers on this machine: `python -m multihost.launch`.

Usage:

  python -m multihost.launch --num_processes=2 --devices_per_process=2 \\
      [--timeout=SECONDS] [--grace_period=SECONDS] -- python train.py --flag

Each controller gets an environment in which both `multihost.initialize()`
and a bare `jax.distributed.initialize()` work unchanged (see `child_env`):
a free loopback coordinator port, `JAX_NUM_CPU_DEVICES=K` CPU devices, and an
Open MPI-like environment that JAX auto-detects. Every output line is
streamed with its process index (`[p1] ...`). The first failure stops the
run: after a grace period the launcher stops the others (SIGTERM, then
SIGKILL) and exits with the first failing process's status (128+signal for a
signal); a summary says who failed first and how. When process 0, which
hosts JAX's coordination service, dies first, the summary says so and does
not blame the survivors that the JAX runtime then aborted. `--timeout`
bounds the whole run (exit status 124). SIGINT/SIGTERM/SIGHUP to the
launcher are forwarded to the controllers, which are then killed; nothing is
left running.

The same machinery is a library, for tests and the pytest plugin:

  result = launch.launch(['python', 'script.py'], num_processes=2,
                         devices_per_process=2, timeout=60)
  assert result.ok, result.summary

  with launch.Controllers(cmd, num_processes=3) as cluster:
    cluster.wait_for_output(1, 'ready', timeout=30)
    cluster.kill(0, signal.SIGKILL)
    result = cluster.wait(timeout=30)
"""

from __future__ import annotations

import argparse
import atexit
import collections.abc
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TextIO
import weakref

from multihost import env as env_lib

# Exit status of a run stopped by its timeout (as coreutils `timeout`).
TIMEOUT_EXIT_STATUS = 124
# Longer than the default failure-detection time (10 s heartbeat timeout, see
# multihost.initialize), so survivors can raise ProcessFailureError and exit
# on their own before they are stopped.
DEFAULT_GRACE_PERIOD_S = 15.0
DEFAULT_HEARTBEAT_S = float(env_lib.DEFAULT_HEARTBEAT_S)
# How long stopped processes get between SIGTERM (or a forwarded signal) and
# SIGKILL.
DEFAULT_KILL_WAIT_S = 2.0
_POLL_S = 0.02
# Signals the command-line launcher forwards to the controllers (SIGHUP: the
# terminal closed; the controllers, in their own sessions, would not get it).
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def find_free_port(host: str = '127.0.0.1') -> int:
  """A TCP port on `host` that was free a moment ago (binds port 0)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def child_env(process_id: int, *, num_processes: int, devices_per_process: int,
              port: int, base: collections.abc.Mapping[str, str] | None = None,
              host: str = '127.0.0.1') -> dict[str, str]:
  """The environment of controller `process_id` of a local run (see `multihost.env.controller_env`)."""
  return env_lib.controller_env(process_id, num_processes=num_processes,
                                devices_per_process=devices_per_process,
                                port=port, base=base, host=host)


def status_of(returncode: int) -> int:
  """Shell-style exit status: the code, or 128+N for death by signal N."""
  return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int | None) -> str:
  """'exit status 1', 'killed by SIGKILL (status 137)' or 'still running'."""
  if returncode is None:
    return 'still running'
  if returncode < 0:
    return f'killed by {signal_name(-returncode)} (status {128 - returncode})'
  return f'exit status {returncode}'


def signal_name(signum: int) -> str:
  try:
    return signal.Signals(signum).name
  except ValueError:
    return f'signal {signum}'


@dataclasses.dataclass(frozen=True)
class LaunchResult:
  """How a run of N controllers ended.

  Attributes:
    returncodes: per process, as `subprocess` reports them (negative: killed
      by that signal); None only if a process could not be reaped.
    outputs: per process, its stdout and stderr, merged, without prefixes.
    pids: per process, its pid.
    end_times: per process, seconds from the start to its exit (or None).
    first_failure: index of the process that failed first, or None.
    stopped: indices of the processes the launcher stopped (after another's
      failure, the timeout or an interrupt).
    timed_out: whether the timeout stopped the run.
    still_running_at_timeout: the processes that were running at the
      timeout.
    interrupted_by: the signal (SIGINT/SIGTERM/SIGHUP) the launcher got, or
      None.
    exit_code: the launcher's exit status: 0, the first failure's status,
      124 on timeout, or 128+signal when interrupted.
    summary: a human-readable account of all of the above.
  """
  returncodes: tuple[int | None, ...]
  outputs: tuple[str, ...]
  pids: tuple[int, ...]
  end_times: tuple[float | None, ...]
  first_failure: int | None
  stopped: tuple[int, ...]
  timed_out: bool
  still_running_at_timeout: tuple[int, ...]
  interrupted_by: int | None
  exit_code: int
  summary: str

  @property
  def ok(self) -> bool:
    """True when every process exited with status 0."""
    return self.exit_code == 0


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
  policy (first failure stops the others after a grace period; timeout);
  tests that inject failures use `pids`, `kill()` and `wait_for_output()`.

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
      (math.inf: never stop them).
    stream: where to write the prefixed output lines live (None: only
      capture them).
    kill_wait: seconds between SIGTERM and SIGKILL when stopping.
    port: the coordinator port (default: a free one).
    host_service: host JAX's coordination service in this (launcher)
      process instead of in process 0, so that the death of process 0 is an
      ordinary failure the others raise `ProcessFailureError` for, rather
      than one that makes JAX abort them. The controllers must call
      `multihost.initialize()` (not a bare `jax.distributed.initialize()`).
    heartbeat_timeout: with host_service, seconds without heartbeats before
      the service declares a controller dead.
  """

  def __init__(self, command: collections.abc.Sequence[str], *,
               num_processes: int, devices_per_process: int = 1,
               env: collections.abc.Mapping[str, str] | None = None,
               cwd: str | os.PathLike[str] | None = None,
               grace_period: float = DEFAULT_GRACE_PERIOD_S,
               stream: TextIO | None = None,
               kill_wait: float = DEFAULT_KILL_WAIT_S,
               port: int | None = None,
               host_service: bool = False,
               heartbeat_timeout: float = DEFAULT_HEARTBEAT_S):
    if isinstance(command, str) or not command:
      raise ValueError(
          f'command must be a non-empty list of arguments, e.g. '
          f"['python', 'train.py']; got {command!r}.")
    if num_processes < 1 or devices_per_process < 1:
      raise ValueError(
          'num_processes and devices_per_process must be at least 1; got '
          f'num_processes={num_processes}, '
          f'devices_per_process={devices_per_process}.')
    if grace_period < 0 or kill_wait < 0:
      raise ValueError(
          f'grace_period and kill_wait must be >= 0 seconds; got '
          f'grace_period={grace_period}, kill_wait={kill_wait}.')
    self.command = [os.fspath(c) for c in command]
    self.num_processes = num_processes
    self.devices_per_process = devices_per_process
    self.grace_period = grace_period
    self.kill_wait = kill_wait
    self.port = port
    self.host_service = host_service
    self.heartbeat_timeout = heartbeat_timeout
    self._service = None
    self._extra_env = dict(env or {})
    self._cwd = cwd
    self._stream = stream
    self._procs: list[subprocess.Popen[bytes]] = []
    self._threads: list[threading.Thread] = []
    self._lines: list[list[str]] = [[] for _ in range(num_processes)]
    self._ended: list[float | None] = [None] * num_processes
    self._returncodes: list[int | None] = [None] * num_processes
    self._stopped: set[int] = set()
    self._lock = threading.Lock()
    self._changed = threading.Condition(self._lock)
    self._write_lock = threading.Lock()
    self._start_time = 0.0
    self._interrupt: int | None = None
    self._signals_seen = 0
    self._result: LaunchResult | None = None

  # Starting and observing.

  def start(self) -> Controllers:
    """Starts every process; returns self."""
    if self._procs:
      raise RuntimeError('These controllers were already started.')
    if self.port is None:
      self.port = find_free_port()
    self._start_time = time.monotonic()
    _LIVE.add(self)
    try:
      service_env = {}
      if self.host_service:
        from multihost import lowlevel  # pylint: disable=g-import-not-at-top
        self._service = lowlevel.start_service(
            f'127.0.0.1:{self.port}', self.num_processes,
            heartbeat_timeout=int(self.heartbeat_timeout))
        service_env = env_lib.external_service_env(self.heartbeat_timeout)
      for i in range(self.num_processes):
        env = child_env(i, num_processes=self.num_processes,
                        devices_per_process=self.devices_per_process,
                        port=self.port)
        env.update(service_env)
        env.update(self._extra_env)
        proc = subprocess.Popen(
            self.command, env=env, cwd=self._cwd, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
        self._procs.append(proc)
        for target in (self._pump, self._reap):
          t = threading.Thread(target=target, args=(i, proc), daemon=True,
                               name=f'multihost-launch-{target.__name__}-{i}')
          t.start()
          self._threads.append(t)
    except BaseException:
      self.stop()
      raise
    return self

  @property
  def pids(self) -> list[int]:
    return [p.pid for p in self._procs]

  @property
  def returncodes(self) -> list[int | None]:
    """Per process: None while running, else as `subprocess` reports it."""
    with self._lock:
      return list(self._returncodes)

  @property
  def outputs(self) -> list[str]:
    """Per process: its merged stdout/stderr so far, without prefixes."""
    with self._lock:
      return [''.join(lines) for lines in self._lines]

  def output(self, index: int) -> str:
    with self._lock:
      return ''.join(self._lines[index])

  def running(self) -> list[int]:
    """Indices of the processes that have not exited."""
    with self._lock:
      return [i for i, rc in enumerate(self._returncodes) if rc is None]

  def elapsed(self) -> float:
    return time.monotonic() - self._start_time

  def wait_for_output(self, index: int, text: str, *,
                      timeout: float) -> bool:
    """Waits until process `index` prints `text`; False on timeout or exit."""
    deadline = time.monotonic() + timeout
    with self._changed:
      while True:
        if text in ''.join(self._lines[index]):
          return True
        if self._returncodes[index] is not None and self._eof[index]:
          return False
        left = deadline - time.monotonic()
        if left <= 0:
          return False
        self._changed.wait(min(left, 0.5))

  def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
    """Sends `sig` to process `index` (its pid only) if it is running."""
    proc = self._procs[index]
    if proc.returncode is None:
      try:
        os.kill(proc.pid, sig)
      except ProcessLookupError:
        pass

  # Waiting, with the run's policy.

  def wait(self, timeout: float | None = None) -> LaunchResult:
    """Waits for the run to end, enforcing its policy, and stops the rest.

    The first process to fail (non-zero status or a signal) starts the grace
    period; at its end the others are stopped. At `timeout` seconds from the
    start, every process still running is stopped. Nothing is running when
    this returns.

    Args:
      timeout: seconds for the whole run, counted from `start()`; None waits
        without limit.

    Returns:
      The `LaunchResult`.
    """
    if not self._procs:
      self.start()
    deadline = None if timeout is None else self._start_time + timeout
    timed_out = False
    at_timeout: list[int] = []
    first_failure_at: float | None = None
    try:
      while True:
        now = time.monotonic()
        with self._changed:
          running = [i for i, rc in enumerate(self._returncodes) if rc is None]
          failed = [i for i, rc in enumerate(self._returncodes)
                    if rc not in (None, 0)]
          if failed and first_failure_at is None:
            first_failure_at = min(self._ended[i] for i in failed)
        if not running:
          break
        if self._interrupt is not None:
          self._forward(self._interrupt)
          break
        if deadline is not None and now >= deadline:
          timed_out = True
          at_timeout = running
          break
        if (first_failure_at is not None and
            now >= first_failure_at + self.grace_period):
          break
        wake = [t for t in (deadline,
                            None if first_failure_at is None else
                            first_failure_at + self.grace_period)
                if t is not None]
        pause = _POLL_S * 10 if not wake else max(
            0.0, min(_POLL_S * 10, min(wake) - now))
        with self._changed:
          if self._interrupt is None and any(
              rc is None for rc in self._returncodes):
            self._changed.wait(pause)
    finally:
      self.stop()
    self._result = self._make_result(timed_out=timed_out,
                                      at_timeout=at_timeout)
    return self._result

  def stop(self) -> None:
    """Stops every running process: SIGTERM, then SIGKILL after kill_wait."""
    self._signal_running(signal.SIGTERM)
    self._finish()

  def _forward(self, sig: int) -> None:
    """Forwards `sig`; the processes get the grace period to stop cleanly.

    (A program may turn the signal into a clean, collective stop, e.g.
    `recovery` saves an agreed step on Ctrl-C.) A second signal to the
    launcher stops them at once.
    """
    self._signal_running(sig)
    self._signals_seen = 1
    self._finish(wait=max(self.kill_wait, self.grace_period),
                 until_signal=True)

  def _signal_running(self, sig: int) -> None:
    for i, proc in enumerate(self._procs):
      with self._lock:
        if self._returncodes[i] is not None:
          continue
        self._stopped.add(i)
      _signal_group(proc, sig)

  def _finish(self, wait: float | None = None,
              until_signal: bool = False) -> None:
    """Waits (kill_wait) for running processes, SIGKILLs them, reaps all."""
    deadline = time.monotonic() + (self.kill_wait if wait is None else wait)
    with self._changed:
      while (any(rc is None for rc in self._returncodes[:len(self._procs)])
             and time.monotonic() < deadline
             and not (until_signal and self._signals_seen > 1)):
        self._changed.wait(max(0.0, min(0.1, deadline - time.monotonic())))
    for i, proc in enumerate(self._procs):
      if proc.returncode is None and self._returncodes[i] is None:
        with self._lock:
          self._stopped.add(i)
        _signal_group(proc, signal.SIGKILL)
    for proc in self._procs:
      try:
        proc.wait(timeout=10)
      except subprocess.TimeoutExpired:  # Unkillable (D state); report it.
        pass
    for t in self._threads:
      t.join(timeout=5)
    if self._service is not None:
      self._service.shutdown()
      self._service = None
    _LIVE.discard(self)

  # Context manager.

  def __enter__(self) -> Controllers:
    if not self._procs:
      self.start()
    return self

  def __exit__(self, *exc_info) -> None:
    self.stop()

  # Signal forwarding (for the command-line launcher, main thread only).

  def forward_signals(self) -> collections.abc.Callable[[], None]:
    """Makes SIGINT/SIGTERM/SIGHUP stop the run; returns the undo function.

    The signal is forwarded to the running processes, which are killed
    `kill_wait` seconds later. (Only a SIGKILL of the launcher itself can
    leave them running.)
    """
    previous = {}

    def handler(signum, frame):
      # No lock here: the handler runs on the main thread, which may hold
      # `_lock` already (a deadlock). The wait loop polls `_interrupt`.
      del frame
      if self._interrupt is None:
        self._interrupt = signum
      else:
        self._signals_seen += 1  # A second signal: stop at once.

    for sig in _FORWARDED_SIGNALS:
      previous[sig] = signal.signal(sig, handler)

    def restore():
      for sig, old in previous.items():
        signal.signal(sig, old)

    return restore

  # Threads.

  @property
  def _eof(self) -> list[bool]:
    return [not t.is_alive() for t in self._threads[0::2]]

  def _pump(self, index: int, proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None
    for raw in iter(proc.stdout.readline, b''):
      line = raw.decode('utf-8', errors='replace')
      if not line.endswith('\n'):
        line += '\n'
      with self._changed:
        self._lines[index].append(line)
        self._changed.notify_all()
      if self._stream is not None:
        with self._write_lock:
          try:
            self._stream.write(f'[p{index}] {line}')
            self._stream.flush()
          except (OSError, ValueError):  # Closed stream: keep capturing.
            pass
    proc.stdout.close()
    with self._changed:
      self._changed.notify_all()

  def _reap(self, index: int, proc: subprocess.Popen[bytes]) -> None:
    returncode = proc.wait()
    with self._changed:
      self._returncodes[index] = returncode
      self._ended[index] = time.monotonic()
      self._changed.notify_all()

  # The result.

  def _make_result(self, *, timed_out: bool,
                   at_timeout: list[int]) -> LaunchResult:
    with self._lock:
      rcs = list(self._returncodes)
      ended = list(self._ended)
      stopped = set(self._stopped)
      lines = [''.join(x) for x in self._lines]
    # A process we stopped did not fail by itself; only the others count.
    failed = [i for i, rc in enumerate(rcs)
              if rc not in (None, 0) and i not in stopped]
    first = min(failed, key=lambda i: (ended[i], i)) if failed else None
    if (first not in (None, 0) and 0 in failed and
        rcs[first] == -signal.SIGABRT and rcs[0] != -signal.SIGABRT and
        ended[0] - ended[first] < 0.5):  # type: ignore[operator]
      # The JAX runtime aborts the others when process 0's coordination
      # service goes; if their exits were seen first, process 0 still caused
      # them.
      first = 0
    if self._interrupt is not None:
      exit_code = 128 + self._interrupt
    elif first is not None:
      exit_code = status_of(rcs[first])  # type: ignore[arg-type]
    elif timed_out:
      exit_code = TIMEOUT_EXIT_STATUS
    elif any(rc != 0 for rc in rcs):  # E.g. stopped yet exited non-zero.
      exit_code = next(status_of(rc) if rc is not None else 1 for rc in rcs
                       if rc != 0)
    else:
      exit_code = 0
    rel = [None if t is None else t - self._start_time for t in ended]
    summary = self._summary(rcs, rel, stopped, first, timed_out, at_timeout,
                            exit_code)
    return LaunchResult(
        returncodes=tuple(rcs), outputs=tuple(lines), pids=tuple(self.pids),
        end_times=tuple(rel), first_failure=first,
        stopped=tuple(sorted(stopped)), timed_out=timed_out,
        still_running_at_timeout=tuple(at_timeout),
        interrupted_by=self._interrupt, exit_code=exit_code, summary=summary)

  def _summary(self, rcs, rel, stopped, first, timed_out, at_timeout,
               exit_code) -> str:
    n = self.num_processes
    total = time.monotonic() - self._start_time
    out = [f'multihost.launch: {n} process(es) x {self.devices_per_process} '
           f'CPU device(s), {total:.1f} s, exit status {exit_code}.']
    for i, rc in enumerate(rcs):
      when = '' if rel[i] is None else f' at {rel[i]:.1f} s'
      note = ''
      if i == first:
        note = '  <- failed first'
      elif i in stopped:
        note = '  (stopped by the launcher)'
      out.append(f'  [p{i}] pid {self.pids[i]}: {describe(rc)}{when}{note}')
    if self._interrupt is not None:
      out.append(f'Interrupted by {signal_name(self._interrupt)}: forwarded '
                 'it to the running processes, gave them the grace period '
                 'to stop, then stopped the rest.')
    if timed_out:
      out.append(
          f'Timed out: the run took longer than its timeout; processes '
          f'{at_timeout} were still running and were stopped. Raise '
          '--timeout if the run needs longer, or look for a process waiting '
          'for a peer (a collective one process did not call).')
    if first is not None:
      how = describe(rcs[first])
      others = [i for i in range(n) if i != first]
      collateral = [i for i in others
                    if rcs[i] not in (None, 0) and i not in stopped]
      if first == 0 and n > 1 and not self.host_service:
        out.append(
            f'Process 0, which hosts the JAX coordination service, died '
            f'first: {how}.')
        if collateral:
          aborts = [i for i in collateral
                    if rcs[i] == -signal.SIGABRT]
          detail = (' (SIGABRT)' if aborts == collateral else
                    ' (' + ', '.join(f'p{i}: {describe(rcs[i])}'
                                     for i in collateral) + ')')
          out.append(
              f'The JAX runtime then aborted the other processes {collateral}'
              f'{detail} because their coordination service was gone; they '
              'are not the cause. Look at the output of process 0 ([p0]).')
        else:
          out.append('Look at the output of process 0 ([p0]).')
      else:
        out.append(f'First failure: process {first} ({how}). Look at its '
                   f'output ([p{first}]).')
      if stopped:
        out.append(f'Processes {sorted(stopped)} were stopped after the '
                   f'{self.grace_period:g} s grace period.')
    return '\n'.join(out)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
  """Signals the process group the launcher created for `proc`."""
  if proc.returncode is not None:
    return
  try:
    os.killpg(proc.pid, sig)  # pgid == pid: start_new_session=True.
  except (ProcessLookupError, PermissionError):
    try:
      os.kill(proc.pid, sig)
    except ProcessLookupError:
      pass


def launch(command: collections.abc.Sequence[str], *, num_processes: int,
           devices_per_process: int = 1, timeout: float | None = None,
           grace_period: float = DEFAULT_GRACE_PERIOD_S,
           env: collections.abc.Mapping[str, str] | None = None,
           cwd: str | os.PathLike[str] | None = None,
           stream: TextIO | None = None,
           summary_stream: TextIO | None = None,
           forward_signals: bool = False,
           kill_wait: float = DEFAULT_KILL_WAIT_S,
           host_service: bool = False) -> LaunchResult:
  """Runs `command` as N local controllers and returns how they ended.

  Args:
    command: the program and its arguments, run by every process.
    num_processes: number of controllers.
    devices_per_process: CPU devices per controller.
    timeout: seconds for the whole run; None for no limit.
    grace_period: seconds the others get after the first failure.
    env: extra environment variables for every process.
    cwd: working directory of the processes.
    stream: where to stream the `[pN] `-prefixed output (None: capture only).
    summary_stream: where to print the summary at the end (None: don't).
    forward_signals: stop the run on SIGINT/SIGTERM/SIGHUP to this process
      (main thread only; used by the command-line launcher).
    kill_wait: seconds between SIGTERM and SIGKILL when stopping processes
      (JAX catches SIGTERM as a preemption notice, so it rarely ends them).
    host_service: host the coordination service in this process (see
      `Controllers`).

  Returns:
    A `LaunchResult`; `result.exit_code` is what a launcher should exit with.
  """
  cluster = Controllers(command, num_processes=num_processes,
                        devices_per_process=devices_per_process, env=env,
                        cwd=cwd, grace_period=grace_period, stream=stream,
                        kill_wait=kill_wait, host_service=host_service)
  restore = cluster.forward_signals() if forward_signals else None
  try:
    with cluster:
      result = cluster.wait(timeout)
  finally:
    if restore is not None:
      restore()
  if summary_stream is not None:
    summary_stream.write(result.summary + '\n')
    summary_stream.flush()
  return result


def split_command(argv: collections.abc.Sequence[str]
                  ) -> tuple[list[str], list[str]]:
  """Splits `[options..., '--', command...]` into options and command."""
  argv = list(argv)
  if '--' in argv:
    at = argv.index('--')
    return argv[:at], argv[at + 1:]
  return argv, []


def main(argv: collections.abc.Sequence[str] | None = None) -> int:
  """Command-line entry point of `python -m multihost.launch`."""
  argv = sys.argv[1:] if argv is None else list(argv)
  options, command = split_command(argv)
  parser = argparse.ArgumentParser(
      prog='python -m multihost.launch',
      description='Run N JAX controllers on this machine.',
      usage='%(prog)s --num_processes=N [--devices_per_process=K] '
            '[--timeout=S] [--grace_period=S] [--host_service] -- COMMAND '
            '[ARGS...]')
  parser.add_argument('--num_processes', type=int, required=True)
  parser.add_argument('--devices_per_process', type=int, default=1)
  parser.add_argument('--timeout', type=float, default=None,
                      help='seconds for the whole run (exit status 124)')
  parser.add_argument('--grace_period', type=float,
                      default=DEFAULT_GRACE_PERIOD_S,
                      help='seconds the others get after the first failure')
  parser.add_argument('--host_service', action='store_true',
                      help='host the coordination service in the launcher, '
                      'so that a death of process 0 is reported like any '
                      'other (the command must use multihost.initialize())')
  args = parser.parse_args(options)
  if not command:
    parser.error('give the command after --, e.g. -- python train.py')
  if args.num_processes < 1 or args.devices_per_process < 1:
    parser.error(f'--num_processes and --devices_per_process must be at '
                 f'least 1; got {args.num_processes} and '
                 f'{args.devices_per_process}.')
  return run_cli(command, num_processes=args.num_processes,
                 devices_per_process=args.devices_per_process,
                 timeout=args.timeout, grace_period=args.grace_period,
                 host_service=args.host_service)


def run_cli(command: list[str], *, num_processes: int,
            devices_per_process: int, timeout: float | None,
            grace_period: float, host_service: bool = False) -> int:
  """Runs the command with live prefixed output and a summary on stderr."""
  try:
    result = launch(command, num_processes=num_processes,
                    devices_per_process=devices_per_process, timeout=timeout,
                    grace_period=grace_period, stream=sys.stdout,
                    summary_stream=sys.stderr, forward_signals=True,
                    host_service=host_service)
  except OSError as e:  # The command itself could not start (as a shell).
    sys.stderr.write(
        f'multihost.launch: cannot run {command[0]!r}: {e.strerror}. Check '
        'the command after --; give a path or a program on $PATH.\n')
    return 127 if isinstance(e, FileNotFoundError) else 126
  return result.exit_code


if __name__ == '__main__':
  sys.exit(main())
