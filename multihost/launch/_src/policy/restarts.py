"""Pure: the result of a run of several attempts (`--max_restarts`): every attempt, how it ended, and what followed.

Each attempt has its own `LaunchResult` (`_report.report`); `combine()`
makes the run's result from them: the last attempt's, with `attempts` set
and a summary that lists every attempt before the last one's own summary.
"""

from __future__ import annotations

import collections.abc
import dataclasses

from multihost import env as env_lib
from multihost.launch._src.policy import policy as _policy
from multihost.launch._src.report import observed as _observed
from multihost.launch._src.report import report as _report


def not_retried(result: _report.LaunchResult) -> str | None:
  """Why an attempt was not restarted although it failed: a process said restarting will not help; else None."""
  i = _policy.not_retryable(result.returncodes, result.stopped,
                            result.end_times)
  if i is None:
    return None
  return (f'not restarted: process {i} exited with status '
          f'{env_lib.NO_RETRY_EXIT_STATUS}, which says restarting will not '
          'help (bad flags, a missing or unusable checkpoint, settings the '
          f'processes disagree on); fix what [p{i}] names and run again')


def attempt_cause(result: _report.LaunchResult) -> str:
  """How one attempt ended, in a few words ('process 1 failed first (killed by SIGKILL (status 137))')."""
  if result.interrupted_by is not None:
    return f'interrupted by {_observed.signal_name(result.interrupted_by)}'
  if result.first_failure is not None:
    i = result.first_failure
    cause = (f'process {i} failed first '
             f'({_observed.describe(result.returncodes[i])})')
    if result.first_error is not None:
      cause += f', raised {result.first_error!r}'
    return cause
  if result.timed_out:
    return 'timed out'
  if result.ok:
    return 'every process exited 0'
  return f'exit status {result.exit_code}'


def combine(attempts: collections.abc.Sequence[_report.LaunchResult], *,
            starts: collections.abc.Sequence[float], max_restarts: int,
            elapsed: float) -> _report.LaunchResult:
  """The run's result from its attempts' (in order; `starts`: seconds from the run's start to each).

  Without restarts allowed (`max_restarts` 0) the summary is the one
  attempt's; otherwise it lists every attempt, its cause and what followed
  (a restart, success, no restarts left, or no restart because a process
  exited with `NO_RETRY_EXIT_STATUS`), then the last attempt's summary.
  """
  attempts = tuple(attempts)
  last = attempts[-1]
  if max_restarts == 0 and len(attempts) == 1:
    return dataclasses.replace(last, attempts=attempts)
  n = len(attempts)
  lines = [f'multihost.launch: {n} attempt(s) (--max_restarts='
           f'{max_restarts}), {elapsed:.1f} s in all, exit status '
           f'{last.exit_code}.']
  for k, (attempt, start) in enumerate(zip(attempts, starts, strict=True)):
    if k < n - 1:
      then = f'restarted all (restart {k + 1} of {max_restarts})'
    elif attempt.ok:
      then = 'the run succeeded'
    elif (attempt.interrupted_by is None and not attempt.timed_out and
          (why := not_retried(attempt)) is not None):
      then = why
    elif (attempt.interrupted_by is None and not attempt.timed_out and
          k >= max_restarts):
      then = f'no restarts left (--max_restarts={max_restarts})'
    else:
      then = 'the run ended'
    lines.append(f'  attempt {k} ({env_lib.RESTART_COUNT}={k}) at '
                 f'{start:.1f} s: {attempt_cause(attempt)}; {then}.')
  lines.append(f'The last attempt ({n - 1}):')
  lines.append(last.summary)
  return dataclasses.replace(last, attempts=attempts,
                             summary='\n'.join(lines))
