"""The human-readable account of a finished run: one line per process, then who failed first, how, and where the others were."""

from __future__ import annotations

import signal

from multihost.launch._src.report import evidence as _evidence
from multihost.launch._src.report.observed import ABORT_RACE_S
from multihost.launch._src.report.observed import Observed
from multihost.launch._src.report.observed import describe
from multihost.launch._src.report.observed import signal_name


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
    error = raised[i]
    if error is not None and rc != 0:
      when += f', raised at {error.time:.1f} s'
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
                all(end is None or end >= end0 - ABORT_RACE_S
                    for end in (run.end_times[i] for i in collateral)))
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
  if error is not None and _raised_before_exit(run, first, raised):
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
  error = raised[first]
  at = (error.time if error is not None and _raised_before_exit(
      run, first, raised) else run.end_times[first])
  if at is None or n < 2:
    return ''
  others = '; '.join(doing_at(run, i, at, raised)
                     for i in range(n) if i != first)
  return f'at {at:.1f} s: {others}'
