"""`launch()`: runs N controllers of a command to the end, with the launcher's signals forwarded and the summary printed."""

from __future__ import annotations

import collections.abc
import os
import tempfile
import time
from typing import TextIO

from multihost import env as env_lib
from multihost.launch._src.policy import policy as _policy
from multihost.launch._src.report import report as _report
from multihost.launch._src.run import controllers as _controllers
from multihost.launch._src.run import trace as _trace


def launch(command: collections.abc.Sequence[str], *, num_processes: int,
           devices_per_process: int = 1, timeout: float | None = None,
           grace_period: float = _policy.DEFAULT_GRACE_PERIOD_S,
           env: collections.abc.Mapping[str, str] | None = None,
           cwd: str | os.PathLike[str] | None = None,
           stream: TextIO | None = None,
           summary_stream: TextIO | None = None,
           forward_signals: bool = False,
           kill_wait: float = _policy.DEFAULT_KILL_WAIT_S,
           host_service: bool = False,
           hosts: str | None = None,
           max_restarts: int = 0,
           trace: str | os.PathLike[str] | None = None,
           compilation_cache_dir: str | os.PathLike[str] | None = None,
           log_dir: str | os.PathLike[str] | None = None,
           hold_tracebacks: bool = True
           ) -> _report.LaunchResult:
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
    hosts: None, or 'netns' for one simulated host per controller (see
      `Controllers`).
    max_restarts: start every controller again after a failed attempt, up
      to this many times (see `Controllers`).
    compilation_cache_dir: JAX's persistent compilation cache folder for
      every attempt (see `Controllers`; None: the user's
      $JAX_COMPILATION_CACHE_DIR, else with restarts a temporary one).
    log_dir: where a restarted attempt leaves every line of each process,
      in a folder of this run's own (see `Controllers`; None: a fresh
      folder under the temp folder).
    hold_tracebacks: while restarts are left, hold tracebacks back from
      `stream` until it is known whether the failure heals (see
      `Controllers`); False streams every line live.
    trace: write the run's timeline here (Chrome trace-event JSON): each
      controller dumps its flight recorder at exit into a folder named by
      $MULTIHOST_TRACE_DIR, merged here at the end, failures marked; the
      summary then names the first divergence between the processes' calls
      and, for a process killed by a signal, its last completed call, the
      call it never arrived at and who waited for it.
      A trace that cannot be written is said so in the summary (with the
      folder where the dumps were kept); the run's result is its own.

  Returns:
    A `LaunchResult`; `result.exit_code` is what a launcher should exit with.
  """
  folder = None
  if trace is not None:
    folder = tempfile.mkdtemp(prefix='multihost-trace-')
    env = {**(env or {}), env_lib.TRACE_DIR: folder}
  run_wall0, run_mono0 = time.time(), time.monotonic()
  cluster = _controllers.Controllers(
      command, num_processes=num_processes,
      devices_per_process=devices_per_process, env=env, cwd=cwd,
      grace_period=grace_period, stream=stream, kill_wait=kill_wait,
      host_service=host_service, hosts=hosts, max_restarts=max_restarts,
      compilation_cache_dir=compilation_cache_dir, log_dir=log_dir,
      hold_tracebacks=hold_tracebacks)
  restore = cluster.forward_signals() if forward_signals else None
  try:
    with cluster:
      result = cluster.wait(timeout)
  finally:
    if restore is not None:
      restore()
  if folder is not None and trace is not None:  # (a folder only for a trace)
    # The run started when the controllers' clock did (`Controllers`).
    result = _trace.noted(
        result, os.fspath(trace), folder, num_processes=num_processes,
        run_wall0=run_wall0 + cluster.run_start - run_mono0,
        starts=cluster.attempt_starts)
  if summary_stream is not None:
    summary_stream.write(result.summary + '\n')
    summary_stream.flush()
  return result
