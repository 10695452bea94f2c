"""One attempt of a run: its controllers' environments, its supervision to the end under the run's policy, what the launcher saw of it, and its log files when it is restarted.

`Controllers` (`_controllers`) owns the run (its hosts, port, service and
attempts); these are the steps of one attempt, apart from that state.
"""

from __future__ import annotations

import collections.abc
import os
import sys
import tempfile
import time
from typing import TextIO

from multihost import env as env_lib
from multihost.launch._src.policy import policy as _policy
from multihost.launch._src.processes import environment as _environment
from multihost.launch._src.processes import output as _output
from multihost.launch._src.processes import processes as _processes
from multihost.launch._src.processes import signals as _signals
from multihost.launch._src.report import observed as _observed
from multihost.launch._src.report import report as _report


def commands(command: collections.abc.Sequence[str], num_processes: int,
             hosts) -> tuple[str, list[list[str]]]:
  """(the coordinator's address, each controller's command): labelled for `ps`, and on its simulated host if `hosts` (a `multihost.netns.SimulatedHosts`) is given."""
  address = '127.0.0.1'
  out = [_environment.labelled(command, i) for i in range(num_processes)]
  if hosts is not None:
    address = hosts.address(0)
    out = [hosts.command(i, out[i]) for i in range(num_processes)]
  return address, out


def environments(*, num_processes: int, devices_per_process: int, port: int,
                 address: str, service_env: collections.abc.Mapping[str, str],
                 extra_env: collections.abc.Mapping[str, str],
                 compilation_cache_dir: str | None,
                 restart_count: int) -> list[dict[str, str]]:
  """Every controller's environment for attempt `restart_count`: its place in the job, then the service's and the user's variables, the compilation cache and the attempt's number."""
  envs = []
  for i in range(num_processes):
    env = _environment.child_env(
        i, num_processes=num_processes,
        devices_per_process=devices_per_process, port=port, host=address)
    env.update(service_env)
    env.update(extra_env)
    if compilation_cache_dir is not None:
      env[env_lib.COMPILATION_CACHE_DIR] = compilation_cache_dir
    env[env_lib.RESTART_COUNT] = str(restart_count)
    envs.append(env)
  return envs


def supervise(procs: _processes.Processes, *, timeout: float | None,
              grace_period: float, kill_wait: float, restart_at_once: bool,
              hold: bool, interrupts: _signals.Interrupts,
              poll_signals: collections.abc.Callable[[], int | None],
              stop: collections.abc.Callable[[float], None]) -> _policy.Step:
  """Supervises an attempt's processes to its end (`timeout` seconds from now at most) and stops them (`stop(kill_wait)`, whatever happened); returns how it ended.

  A failure followed by a restart stops the others after at most
  `_policy.RESTART_KILL_WAIT_S` and, with `hold`, holds their last lines;
  an interrupt is forwarded to the processes first.
  """
  step = _policy.Step(_policy.ALL_EXITED)
  try:
    step = _policy.supervise(procs, timeout=timeout,
                             grace_period=grace_period,
                             interrupt=poll_signals,
                             restart_at_once=restart_at_once,
                             tick=lambda: release_stale(procs))
    if step.action == _policy.RESTART_NOW and hold:
      procs.output.hold_all()  # The stopped ones' last words.
    # (`interrupts.first` is set once a signal came, as it has here)
    if step.action == _policy.INTERRUPTED and interrupts.first is not None:
      _policy.forward(procs, interrupts.first,
                      wait=max(kill_wait, grace_period),
                      again=interrupts.again)
  finally:
    stop(min(kill_wait, _policy.RESTART_KILL_WAIT_S)
         if step.action == _policy.RESTART_NOW else kill_wait)
  return step


def release_stale(procs: _processes.Processes) -> None:
  """While supervising (caller holds `changed`): streams held tracebacks that no failure followed, or all when a process said restarting will not help."""
  if _policy.not_retryable(procs.returncodes_locked(),
                           procs.stopped_locked()) is not None:
    procs.output.release()
  else:
    procs.output.release(older_than=_output.HELD_TRACEBACK_S)


def result(procs: _processes.Processes, step: _policy.Step, *,
           devices_per_process: int, grace_period: float,
           host_service: bool, interrupted_by: int | None,
           hosts_kind: str | None,
           host_addresses: tuple[str, ...]) -> _report.LaunchResult:
  """The `LaunchResult` of a finished attempt, from what its processes left and how it ended (`step`)."""
  timed_out = step.action == _policy.TIMED_OUT
  with procs.changed:
    observed = _observed.Observed(
        returncodes=tuple(procs.returncodes_locked()),
        end_times=tuple(procs.end_times_locked()),
        stopped=procs.stopped_locked(),
        pids=tuple(procs.pids),
        outputs=tuple(procs.output.text_locked(i)
                      for i in range(procs.num_processes)),
        devices_per_process=devices_per_process,
        elapsed=time.monotonic() - procs.start_time,
        grace_period=grace_period,
        host_service=host_service, timed_out=timed_out,
        still_running_at_timeout=step.running if timed_out else (),
        interrupted_by=interrupted_by,
        line_times=procs.line_times_locked(),
        hosts=hosts_kind, host_addresses=host_addresses,
        stopped_to_restart=step.action == _policy.RESTART_NOW)
  return _report.report(observed)


def keep_logs(outputs: collections.abc.Sequence[str], *, log_dir: str,
              attempt: int) -> str:
  """Writes each process's lines of `attempt` to `log_dir/attempt-K.pI.log` (made if missing); returns their pattern. Raises OSError."""
  os.makedirs(log_dir, exist_ok=True)
  for i, text in enumerate(outputs):
    path = os.path.join(log_dir, f'attempt-{attempt}.p{i}.log')
    with open(path, 'w', encoding='utf-8') as f:
      f.write(text)
  return os.path.join(log_dir, f'attempt-{attempt}.p*.log')


def say(stream: TextIO | None, text: str) -> None:
  """Writes a `[launcher] ` line to the live `stream`, if there is one."""
  if stream is None:
    return
  try:
    stream.write(f'[launcher] {text}\n')
    stream.flush()
  except (OSError, ValueError):  # Closed stream: the summary still tells.
    pass


def run_folder(log_dir: str | None) -> str:
  """A new folder for this run's attempt logs: `log_dir/run-<UTC time>-<random>` (made, with `log_dir` if missing), never one an earlier run made; a fresh `multihost-launch-logs-*` under the temp folder when `log_dir` is None. Raises OSError."""
  if log_dir is None:
    return tempfile.mkdtemp(prefix='multihost-launch-logs-')
  os.makedirs(log_dir, exist_ok=True)
  stamp = time.strftime('%Y%m%d-%H%M%S', time.gmtime())
  return tempfile.mkdtemp(prefix=f'run-{stamp}-', dir=log_dir)


def tell_restarted(stream: TextIO | None, attempt: _report.LaunchResult,
                   k: int, *, held: int, log_dir: str | None,
                   run_log_dir: str | None) -> str | None:
  """Writes failed attempt `k`'s output to one file per process (in `run_log_dir`, this run's folder, made under `log_dir` if None: `run_folder`) and says where the others were and where the files are; returns this run's folder."""
  if stream is None:
    return run_log_dir
  if attempt.where:
    say(stream, f'  {attempt.where}.')
  try:
    if run_log_dir is None:
      run_log_dir = run_folder(log_dir)
    files = keep_logs(attempt.outputs, log_dir=run_log_dir, attempt=k)
  except OSError as e:
    say(stream, f'  {held} line(s) held back (tracebacks, the stopped '
        f'processes\' last words) could not be written to '
        f'{run_log_dir or log_dir}: {e.strerror}.')
    return run_log_dir
  what = (f'{held} line(s) held back (tracebacks, the stopped processes\' '
          'last words); ' if held else '')
  say(stream, f'  {what}every line of attempt {k}: {files}.')
  return run_log_dir


def ask_where(procs: _processes.Processes) -> None:
  """Sends SIGUSR1 to every running controller that handles it (so it prints where it is); says which ones do not."""
  for i, pid in enumerate(procs.pids):
    if procs.returncodes_locked()[i] is not None:
      continue
    if _signals.catches(pid, _signals.REPORT_SIGNAL):
      procs.kill(i, _signals.REPORT_SIGNAL)
    else:
      sys.stderr.write(f'[launcher] process {i} does not handle SIGUSR1 '
                       '(it has not called multihost.initialize()); not '
                       'asked where it is.\n')
      sys.stderr.flush()
