"""How a run ended, as a pure function of what was observed: exit status, who failed first, the summary.

Nothing here starts, signals or waits for a process: `report()` takes a
snapshot of a finished run (`Observed`) and returns its `LaunchResult`, so
the blame heuristic is unit-tested without processes (cf. torchrun's
`multiprocessing/errors`: "Root Cause (first observed failure)").
"""

from __future__ import annotations

import dataclasses
import re
import signal

# Exit status of a run stopped by its timeout (as coreutils `timeout`).
TIMEOUT_EXIT_STATUS = 124
# Process 0's death is still blamed when the JAX runtime's aborts of the
# others were seen up to this many seconds before it (the reaper threads
# observe exits in no particular order).
_ABORT_RACE_S = 0.5


def status_of(returncode: int) -> int:
  """Shell-style exit status: the code, or 128+N for death by signal N."""
  return 128 - returncode if returncode < 0 else returncode


def signal_name(signum: int) -> str:
  """'SIGKILL' for 9; 'signal N' for a number that names no signal."""
  try:
    return signal.Signals(signum).name
  except ValueError:
    return f'signal {signum}'


def describe(returncode: int | None) -> str:
  """'exit status 1', 'killed by SIGKILL (status 137)' or 'still running'."""
  if returncode is None:
    return 'still running'
  if returncode < 0:
    return f'killed by {signal_name(-returncode)} (status {128 - returncode})'
  return f'exit status {returncode}'


@dataclasses.dataclass(frozen=True)
class Observed:
  """What the launcher saw of a finished run: the input of `report()`.

  Attributes:
    returncodes: per process, as `subprocess` reports them (negative: killed
      by that signal); None if it could not be reaped.
    end_times: per process, seconds from the start to its exit (or None).
    stopped: the processes the launcher stopped (they did not fail alone).
    pids: per process, its pid.
    outputs: per process, its merged stdout and stderr.
    devices_per_process: CPU devices per controller (for the summary).
    elapsed: seconds the whole run took.
    grace_period: seconds the others got after the first failure.
    host_service: whether the launcher hosted the coordination service (then
      process 0 is an ordinary controller).
    timed_out: whether the timeout stopped the run.
    still_running_at_timeout: the processes running at the timeout.
    interrupted_by: the signal the launcher got and forwarded, or None.
  """
  returncodes: tuple[int | None, ...]
  end_times: tuple[float | None, ...]
  stopped: frozenset[int] = frozenset()
  pids: tuple[int, ...] = ()
  outputs: tuple[str, ...] = ()
  devices_per_process: int = 1
  elapsed: float = 0.0
  grace_period: float = 0.0
  host_service: bool = False
  timed_out: bool = False
  still_running_at_timeout: tuple[int, ...] = ()
  interrupted_by: int | None = None


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


def first_failure(returncodes: tuple[int | None, ...],
                  end_times: tuple[float | None, ...],
                  stopped: frozenset[int] = frozenset(),
                  outputs: tuple[str, ...] = ()) -> int | None:
  """The process that caused the run's failure, or None if none failed alone.

  The earliest non-zero exit among the processes the launcher did not stop.
  One exception: when process 0 (which hosts JAX's coordination service)
  failed, and the earlier exit was a SIGABRT seen less than 0.5 s before
  process 0's, process 0 is blamed: the JAX runtime aborts the others when
  their coordination service goes, and the launcher may see those exits
  first. Unless process 0's output (`outputs[0]`) already named that
  process as failed (multihost's `ProcessFailureError`): process 0 then
  outlived its failure, so it is not the cause.
  """
  failed = [i for i, rc in enumerate(returncodes)
            if rc not in (None, 0) and i not in stopped]
  if not failed:
    return None
  inf = float('inf')
  first = min(failed, key=lambda i: (
      inf if end_times[i] is None else end_times[i], i))
  if (first != 0 and 0 in failed and
      returncodes[first] == -signal.SIGABRT and
      returncodes[0] != -signal.SIGABRT and
      end_times[0] is not None and end_times[first] is not None and
      end_times[0] - end_times[first] < _ABORT_RACE_S and
      first not in named_as_failed(outputs[0] if outputs else '')):
    return 0
  return first


def named_as_failed(output: str) -> set[int]:
  """The processes a process's output names as failed ("process(es) [1, 2] failed")."""
  return {int(i) for found in _NAMED_FAILED.findall(output)
          for i in found.split(',') if i.strip()}


_NAMED_FAILED = re.compile(r'process\(es\) \[([0-9, ]*)\] failed')


def exit_code(returncodes: tuple[int | None, ...], *, first: int | None,
              timed_out: bool, interrupted_by: int | None) -> int:
  """The launcher's exit status: 128+signal if interrupted, else the first failure's, 124 on timeout, else 0."""
  if interrupted_by is not None:
    return 128 + interrupted_by
  if first is not None:
    return status_of(returncodes[first])  # type: ignore[arg-type]
  if timed_out:
    return TIMEOUT_EXIT_STATUS
  for rc in returncodes:  # E.g. stopped, yet exited non-zero.
    if rc != 0:
      return 1 if rc is None else status_of(rc)
  return 0


def summary(run: Observed, *, first: int | None, code: int) -> str:
  """The human-readable account of a run: one line per process, then who is to blame and why."""
  rcs = run.returncodes
  n = len(rcs)
  stopped = run.stopped
  out = [f'multihost.launch: {n} process(es) x {run.devices_per_process} '
         f'CPU device(s), {run.elapsed:.1f} s, exit status {code}.']
  for i, rc in enumerate(rcs):
    end = run.end_times[i]
    when = '' if end is None else f' at {end:.1f} s'
    note = ''
    if i == first:
      note = '  <- failed first'
    elif i in stopped:
      note = '  (stopped by the launcher)'
    pid = run.pids[i] if i < len(run.pids) else '?'
    out.append(f'  [p{i}] pid {pid}: {describe(rc)}{when}{note}')
  if run.interrupted_by is not None:
    out.append(f'Interrupted by {signal_name(run.interrupted_by)}: forwarded '
               'it to the running processes, gave them the grace period '
               'to stop, then stopped the rest.')
  if run.timed_out:
    out.append(
        f'Timed out: the run took longer than its timeout; processes '
        f'{list(run.still_running_at_timeout)} were still running and were '
        'stopped. Raise --timeout if the run needs longer, or look for a '
        'process waiting for a peer (a collective one process did not call).')
  if first is not None:
    how = describe(rcs[first])
    collateral = [i for i in range(n) if i != first and
                  rcs[i] not in (None, 0) and i not in stopped]
    if first == 0 and n > 1 and not run.host_service:
      out.append(
          f'Process 0, which hosts the JAX coordination service, died '
          f'first: {how}.')
      if collateral:
        aborts = [i for i in collateral if rcs[i] == -signal.SIGABRT]
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
      for i in lost_coordinator(rcs, run.outputs):
        out.append(f'Process {i} lost the coordination service (network '
                   'partition or coordinator gone): JAX aborted it '
                   f'("{LOST_SERVICE_MARKER}" in [p{i}]).')
    if stopped:
      out.append(f'Processes {sorted(stopped)} were stopped after the '
                 f'{run.grace_period:g} s grace period.')
  return '\n'.join(out)


# What JAX's client prints before it aborts a process (SIGABRT) that lost
# the coordination service: a missed heartbeat (partition) or a service gone.
LOST_SERVICE_MARKER = ('Terminating process because the JAX distributed '
                       'service detected fatal errors')


def lost_coordinator(returncodes: tuple[int | None, ...],
                     outputs: tuple[str, ...]) -> list[int]:
  """The processes JAX aborted because they lost the coordination service (SIGABRT + its log line)."""
  return [i for i, rc in enumerate(returncodes)
          if rc == -signal.SIGABRT and i < len(outputs)
          and LOST_SERVICE_MARKER in outputs[i]]


def report(run: Observed) -> LaunchResult:
  """The `LaunchResult` of a finished run: who failed first, the exit status and the summary."""
  first = first_failure(run.returncodes, run.end_times, run.stopped,
                        run.outputs)
  code = exit_code(run.returncodes, first=first, timed_out=run.timed_out,
                   interrupted_by=run.interrupted_by)
  return LaunchResult(
      returncodes=tuple(run.returncodes), outputs=tuple(run.outputs),
      pids=tuple(run.pids), end_times=tuple(run.end_times),
      first_failure=first, stopped=tuple(sorted(run.stopped)),
      timed_out=run.timed_out,
      still_running_at_timeout=tuple(run.still_running_at_timeout),
      interrupted_by=run.interrupted_by, exit_code=code,
      summary=summary(run, first=first, code=code))
