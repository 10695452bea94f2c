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

from multihost.launch._src.report import evidence as _evidence
from multihost.launch._src.report import summary as _summary
from multihost.launch._src.report.observed import ABORT_RACE_S
from multihost.launch._src.report.observed import Observed
from multihost.launch._src.report.observed import status_of

# Exit status of a run stopped by its timeout (as coreutils `timeout`).
TIMEOUT_EXIT_STATUS = 124


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
    end, error = end_times[i], raised[i]
    if i in failed and end is not None:
      events.append(end)
    if i in raisers and error is not None:  # (a raiser's is never None)
      events.append(error.time)
    return min(events)

  first = min(set(failed) | set(raisers), key=lambda i: (when(i), i))
  if (first != 0 and 0 in failed and first in failed and
      returncodes[first] == -signal.SIGABRT and
      returncodes[0] != -signal.SIGABRT and
      (end0 := end_times[0]) is not None and
      (end_first := end_times[first]) is not None and
      end0 - end_first < ABORT_RACE_S and
      first not in _evidence.named_as_failed(outputs[0] if outputs else '')):
    return 0
  return first


def exit_code(returncodes: tuple[int | None, ...], *, first: int | None,
              timed_out: bool, interrupted_by: int | None) -> int:
  """The launcher's exit status: 128+signal if interrupted, else the first failure's, 124 on timeout, else 0."""
  if interrupted_by is not None:
    return 128 + interrupted_by
  if first is not None:
    code = returncodes[first]
    if code is None:  # (a first failure has exited)
      raise ValueError(f'process {first}, the first to fail, has not exited.')
    return status_of(code)
  if timed_out:
    return TIMEOUT_EXIT_STATUS
  for rc in returncodes:  # E.g. stopped, yet exited non-zero.
    if rc != 0:
      return 1 if rc is None else status_of(rc)
  return 0


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
      summary=_summary.summary(run, first=first, code=code),
      first_error=None if error is None else error.error,
      where=('' if first is None
             else _summary.where_others(run, first, raised)))
