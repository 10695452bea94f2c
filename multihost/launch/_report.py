"""How a run ended, as a pure function of what was observed: exit status, who failed first, the summary.

Nothing here starts, signals or waits for a process: `report()` takes a
snapshot of a finished run (`Observed`) and returns its `LaunchResult`, so
the blame heuristic is unit-tested without processes (cf. torchrun's
`multiprocessing/errors`: "Root Cause (first observed failure)"). The first
failure is the first error by when it happened: a process's first traceback
(by when the launcher read it) or its exit, whichever came first.
"""

from __future__ import annotations

import dataclasses
import signal
from typing import Any

from multihost.launch import _evidence

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
    line_times: per process, per line of its output, seconds from the
      start to when the launcher read it (empty: not known; then the first
      failure is the first exit).
    hosts: None, or 'netns' when each process ran on a simulated host.
    host_addresses: with hosts, per process, its host's address.
    stopped_to_restart: the launcher stopped the others at the first
      failure, without a grace period, because a restart follows.
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
  line_times: tuple[tuple[float, ...], ...] = ()
  hosts: str | None = None
  host_addresses: tuple[str, ...] = ()
  stopped_to_restart: bool = False

  def lines(self, index: int) -> list[str]:
    """Process `index`'s output lines, without newlines (one per `line_times[index]`)."""
    if index >= len(self.outputs):
      return []
    return self.outputs[index].split('\n')[:-1]

  def raised(self) -> tuple[_evidence.Raised | None, ...]:
    """Per process, its first traceback (None: none, or no times known)."""
    return tuple(
        _evidence.first_raised(self.lines(i), self.line_times[i])
        if i < len(self.line_times) else None
        for i in range(len(self.returncodes)))


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
    first_error: the exception the first failure raised ('ValueError:
      boom'), when its output shows a traceback; else None.
    attempts: with restarts (`max_restarts`), every attempt's own result,
      in order (the last is this one's); else this one alone.
    where: where each other process was at the first failure ('at 8.1 s:
      p0 was running (last line at ...)'); empty when none failed (or there
      is no other process).
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
  first_error: str | None = None
  attempts: tuple[Any, ...] = ()
  where: str = ''

  @property
  def ok(self) -> bool:
    """True when every process exited with status 0."""
    return self.exit_code == 0

  @property
  def restart_count(self) -> int:
    """How many times the launcher restarted the job (attempts - 1)."""
    return max(0, len(self.attempts) - 1)


def first_failure(returncodes: tuple[int | None, ...],
                  end_times: tuple[float | None, ...],
                  stopped: frozenset[int] = frozenset(),
                  outputs: tuple[str, ...] = (),
                  raised: tuple[_evidence.Raised | None, ...] = ()
                  ) -> int | None:
  """The process that caused the run's failure, or None if none failed alone.

  The earliest failure event among the processes that did not exit 0: a
  non-zero exit the launcher did not cause, or a first traceback
  (`raised`, by when the launcher read it), which counts even for a
  process the launcher then stopped (it raised, then lingered). A traceback
  of a process whose output names other processes as failed (multihost's
  `ProcessFailureError`) does not count: that process reacted to their
  failure.

  One exception: when process 0 (which hosts JAX's coordination service)
  failed, and the earlier exit was a SIGABRT seen less than 0.5 s before
  process 0's, process 0 is blamed: the JAX runtime aborts the others when
  their coordination service goes, and the launcher may see those exits
  first. Unless process 0's output (`outputs[0]`) already named that
  process as failed: process 0 then outlived its failure, so it is not the
  cause.
  """
  n = len(returncodes)
  raised = tuple(raised) + (None,) * (n - len(raised))
  failed = [i for i, rc in enumerate(returncodes)
            if rc not in (None, 0) and i not in stopped]
  named = [_evidence.named_as_failed(outputs[i]) if i < len(outputs) else set()
           for i in range(n)]
  raisers = [i for i in range(n) if raised[i] is not None and
             returncodes[i] != 0 and not named[i] - {i}]
  if not failed and not raisers:
    return None
  inf = float('inf')

  def when(i: int) -> float:
    events = [inf]
    if i in failed and end_times[i] is not None:
      events.append(end_times[i])
    if i in raisers:
      events.append(raised[i].time)  # type: ignore[union-attr]
    return min(events)

  first = min(set(failed) | set(raisers), key=lambda i: (when(i), i))
  if (first != 0 and 0 in failed and first in failed and
      returncodes[first] == -signal.SIGABRT and
      returncodes[0] != -signal.SIGABRT and
      end_times[0] is not None and end_times[first] is not None and
      end_times[0] - end_times[first] < _ABORT_RACE_S and
      first not in _evidence.named_as_failed(outputs[0] if outputs else '')):
    return 0
  return first


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


def _header(run: Observed, code: int) -> str:
  n = len(run.returncodes)
  where = ''
  if run.hosts is not None:
    where = (f' on {n} simulated host(s) (--hosts={run.hosts}: a network '
             'namespace and address each)')
  return (f'multihost.launch: {n} process(es) x {run.devices_per_process} '
          f'CPU device(s){where}, {run.elapsed:.1f} s, exit status {code}.')


def doing_at(run: Observed, index: int, when: float,
             raised: tuple[_evidence.Raised | None, ...]) -> str:
  """What process `index` was doing `when` seconds into the run (by its exit and output), and what it did next."""
  end = run.end_times[index]
  rc = run.returncodes[index]
  if end is not None and end <= when:
    return f'p{index} had exited at {end:.1f} s ({describe(rc)})'
  lines = run.lines(index)
  times = run.line_times[index] if index < len(run.line_times) else ()
  last = _evidence.last_line_before(lines, times, when)
  text = f'p{index} was running'
  if last is not None:
    text += f' (last line at {last[0]:.1f} s: {last[1]!r})'
  elif len(times) == len(lines):  # Times known: nothing printed by then.
    text += ' (no output yet)'
  then = raised[index] if index < len(raised) else None
  if then is not None and then.time > when:
    text += f', then raised {then.error!r} at {then.time:.1f} s'
  return text


def summary(run: Observed, *, first: int | None, code: int) -> str:
  """The human-readable account of a run: one line per process, then who is to blame and why."""
  rcs = run.returncodes
  stopped = run.stopped
  raised = run.raised()
  out = [_header(run, code)]
  for i, rc in enumerate(rcs):
    end = run.end_times[i]
    when = '' if end is None else f' at {end:.1f} s'
    if raised[i] is not None and rc != 0:
      when += f', raised at {raised[i].time:.1f} s'  # type: ignore[union-attr]
    note = ''
    if i == first:
      note = '  <- failed first'
      if i in stopped:
        note += ' (then stopped by the launcher)'
    elif i in stopped:
      note = '  (stopped by the launcher)'
    pid = run.pids[i] if i < len(run.pids) else '?'
    host = (f' on {run.host_addresses[i]}' if i < len(run.host_addresses)
            else '')
    out.append(f'  [p{i}] pid {pid}{host}: {describe(rc)}{when}{note}')
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
    out += _blame(run, first, raised)
  return '\n'.join(out)


def _blame(run: Observed, first: int,
           raised: tuple[_evidence.Raised | None, ...]) -> list[str]:
  """The summary's lines on the first failure: who, how, what it raised, what the others were doing."""
  rcs = run.returncodes
  n = len(rcs)
  stopped = run.stopped
  how = describe(rcs[first])
  if first in stopped:  # It raised, then lingered until it was stopped.
    how = f'it raised, then the launcher stopped it: {how}'
  out = []
  collateral = [i for i in range(n) if i != first and
                rcs[i] not in (None, 0) and i not in stopped]
  # Where process 0 hosts the coordination service (its companion process
  # is off): when it died (not only raised) before the others were aborted,
  # their failures followed from its.
  end0 = run.end_times[0]
  aborts = [i for i in collateral if rcs[i] == -signal.SIGABRT]
  died_first = (first == 0 and n > 1 and not run.host_service and bool(aborts) and
                0 not in stopped and end0 is not None and
                all(run.end_times[i] is None or
                    run.end_times[i] >= end0 - _ABORT_RACE_S
                    for i in collateral))
  if died_first:
    out.append(
        f'Process 0, which hosts the JAX coordination service, died '
        f'first: {how}.')
    detail = (' (SIGABRT)' if aborts == collateral else
              ' (' + ', '.join(f'p{i}: {describe(rcs[i])}'
                               for i in collateral) + ')')
    out.append(
        f'The JAX runtime then aborted the other processes {collateral}'
        f'{detail} because their coordination service was gone; they '
        'are not the cause. Look at the output of process 0 ([p0]).')
  else:
    out.append(f'First failure: process {first} ({how}). Look at its '
               f'output ([p{first}]).')
    for i in _evidence.lost_coordinator(rcs, run.outputs):
      out.append(f'Process {i} lost the coordination service (network '
                 'partition or coordinator gone): JAX aborted it '
                 f'("{_evidence.LOST_SERVICE_MARKER}" in [p{i}]).')
  error = raised[first]
  if _raised_before_exit(run, first, raised):
    out.append(f'Process {first} raised first, at {error.time:.1f} s (when '
               f'the launcher read its traceback): {error.error}')
  where = where_others(run, first, raised)
  if where:
    out.append(f'Meanwhile, {where}.')
  if stopped:
    why = ('at the timeout' if run.timed_out else
           'at the interrupt' if run.interrupted_by is not None else
           'at once, to restart the job (restarts are left)'
           if run.stopped_to_restart else
           f'after the {run.grace_period:g} s grace period')
    out.append(f'Processes {sorted(stopped)} were stopped {why}.')
  return out


def _raised_before_exit(run: Observed, first: int,
                        raised: tuple[_evidence.Raised | None, ...]) -> bool:
  """Whether process `first`'s first failure event is its traceback (not its exit)."""
  error = raised[first]
  end = run.end_times[first]
  return error is not None and (end is None or error.time <= end)


def where_others(run: Observed, first: int,
                 raised: tuple[_evidence.Raised | None, ...]) -> str:
  """Where the processes other than `first` were at its failure ('at 8.1 s: p0 was running (...)'); '' when unknown or alone."""
  n = len(run.returncodes)
  at = (raised[first].time  # type: ignore[union-attr]
        if _raised_before_exit(run, first, raised) else run.end_times[first])
  if at is None or n < 2:
    return ''
  others = '; '.join(doing_at(run, i, at, raised)
                     for i in range(n) if i != first)
  return f'at {at:.1f} s: {others}'


def report(run: Observed) -> LaunchResult:
  """The `LaunchResult` of a finished run: who failed first, the exit status and the summary."""
  raised = run.raised()
  first = first_failure(run.returncodes, run.end_times, run.stopped,
                        run.outputs, raised)
  # A first failure the launcher stopped (it raised, then lingered) has no
  # status of its own: the status is the first exit's.
  exited = first is None or (run.returncodes[first] not in (None, 0) and
                             first not in run.stopped)
  by_exit = first if exited else first_failure(
      run.returncodes, run.end_times, run.stopped, run.outputs)
  code = exit_code(run.returncodes, first=by_exit, timed_out=run.timed_out,
                   interrupted_by=run.interrupted_by)
  error = raised[first] if first is not None else None
  return LaunchResult(
      returncodes=tuple(run.returncodes), outputs=tuple(run.outputs),
      pids=tuple(run.pids), end_times=tuple(run.end_times),
      first_failure=first, stopped=tuple(sorted(run.stopped)),
      timed_out=run.timed_out,
      still_running_at_timeout=tuple(run.still_running_at_timeout),
      interrupted_by=run.interrupted_by, exit_code=code,
      summary=summary(run, first=first, code=code),
      first_error=None if error is None else error.error,
      where='' if first is None else where_others(run, first, raised))
