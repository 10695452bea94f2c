"""Pure: per-process flight-recorder dumps -> one Chrome trace-event timeline, clock offsets, the first divergence.

A dump is `runtime.flight.Recorder.snapshot()`'s data (times on that process's
wall clock, seconds). Nothing here reads a clock, a file or a process, so
the merge and the analysis are unit-tested on plain data; the launcher
(`--trace`) and `multihost.write_trace` feed them.

Clocks: every process leaves a collective's barrier at the same moment
(the coordination service answers all waiters together), so process p's
clock offset to the reference (the lowest process with a dump) is the
median, over the calls both recorded as completed, of p's barrier exit
minus the reference's. Each event is drawn at its time minus its process's
offset.

The trace (Chrome's trace-event format, which Perfetto also reads): one track (`pid`) per process, with a thread for its collectives (`X`
events: op, barrier name, call, bytes, wait and move ms), a thread for its
other events (checkpoint saves, restores, ...), and a counter of how late
it arrived at each call (the straggler statistic: its wait's shortfall
from the longest wait of that call). A failed process gets an instant
event where it stopped (how, its last line, its last call as the survivors
saw it). A last track, 'launcher', shows the attempts (restarts).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
import statistics
from typing import Any

COLLECTIVES_TID = 0
EVENTS_TID = 1


def clock_offsets(dumps: Sequence[Mapping[str, Any]]) -> dict[int, float]:
  """Process -> seconds its clock runs ahead of the reference's (see the module docstring)."""
  if not dumps:
    return {}
  ends = {d['process']: {r['call']: r['end'] for r in d['records']
                         if r['end'] is not None} for d in dumps}
  ref = min(ends)
  offsets = {}
  for p, mine in ends.items():
    common = [mine[c] - ends[ref][c] for c in mine if c in ends[ref]]
    offsets[p] = statistics.median(common) if common else 0.0
  return offsets


def _label(record: Mapping[str, Any]) -> str:
  name = f'({record["name"]!r})' if record.get('name') else ''
  return f'{record["op"]}{name}'


def divergence(dumps: Sequence[Mapping[str, Any]], num_processes: int
               ) -> str | None:
  """The first call where the processes disagreed or one stopped arriving, in one line; None if none.

  As torch's flight-recorder analyser does: walk the call numbers the
  rings hold, in order; at each, the processes that recorded it must have
  the same op and barrier name, and every process must have arrived. A
  process arrived if it recorded the call or a later one, or if any
  process's record of the call completed (the barrier let it out, so all
  were there): a call older than a process's ring is not held against it.
  A process with no dump is assumed present only where a barrier proves
  it.

  Args:
    dumps: the processes' dumps of one attempt (at most one per process).
    num_processes: the job's process count.
  """
  if not dumps:
    return None
  by_process = {d['process']: {r['call']: r for r in d['records']}
                for d in dumps}
  calls = sorted({c for calls in by_process.values() for c in calls})
  for call in calls:
    here = {p: calls_[call] for p, calls_ in by_process.items()
            if call in calls_}
    kinds: dict[str, list[int]] = {}
    for p, r in sorted(here.items()):
      kinds.setdefault(_label(r), []).append(p)
    if len(kinds) > 1:
      groups = '; '.join(f'processes {ps} ran {k}'
                         for k, ps in kinds.items())
      return (f'divergence: at call {call} the processes disagreed: '
              f'{groups}.')
    if any(r['end'] is not None for r in here.values()):
      continue  # The barrier completed: every process was there.
    absent = []
    for p in range(num_processes):
      if p in here:
        continue
      later = [c for c in by_process.get(p, {}) if c > call]
      if not later:
        absent.append(p)
    if absent:
      (kind,) = kinds
      waiting = sorted(here)
      waited = max((r['done'] or r['start']) - r['start']
                   for r in here.values())
      return (f'divergence: at call {call} ({kind}) processes {absent} '
              f'stopped arriving; processes {waiting} waited '
              f'{waited:.1f} s for them.')
  return None


def last_seen(dumps: Sequence[Mapping[str, Any]], process: int
              ) -> str | None:
  """What `process` last did as the others' records show: its last completed call, and the call it never arrived at."""
  last_done = None
  missed = None
  for d in dumps:
    if d['process'] == process:
      continue
    for r in d['records']:
      if r['end'] is not None:
        if last_done is None or r['call'] > last_done['call']:
          last_done = r
      elif missed is None or r['call'] < missed['call']:
        missed = r
  parts = []
  if last_done is not None:
    parts.append(f'last completed call {last_done["call"]} '
                 f'({_label(last_done)})')
  if missed is not None:
    parts.append(f'never arrived at call {missed["call"]} '
                 f'({_label(missed)})')
  return '; '.join(parts) or None


def waited_for(dumps: Sequence[Mapping[str, Any]], process: int
               ) -> str | None:
  """Who waited for `process` at the first call it never arrived at, as their records show ('processes [0] waited 9.9 s for it'); None if none did."""
  missed = None
  for d in dumps:
    if d['process'] == process:
      continue
    for r in d['records']:
      if r['end'] is None and (missed is None or r['call'] < missed):
        missed = r['call']
  if missed is None:
    return None
  waits = {d['process']: (r['done'] or r['start']) - r['start']
           for d in dumps if d['process'] != process
           for r in d['records'] if r['call'] == missed and r['end'] is None}
  return (f'processes {sorted(waits)} waited {max(waits.values()):.1f} s '
          'for it')


def straggler_lags(dumps: Sequence[Mapping[str, Any]]
                   ) -> dict[int, dict[int, float]]:
  """Process -> call -> seconds it arrived after the first arrival (calls every dump completed)."""
  waits = {d['process']: {r['call']: r['end'] - r['start']
                          for r in d['records'] if r['end'] is not None}
           for d in dumps}
  if len(waits) < 2:
    return {p: {} for p in waits}
  common = set.intersection(*(set(w) for w in waits.values()))
  lags: dict[int, dict[int, float]] = {p: {} for p in waits}
  for call in common:
    longest = max(w[call] for w in waits.values())
    for p, w in waits.items():
      lags[p][call] = longest - w[call]
  return lags


def straggler_labels(lags: Mapping[int, Mapping[int, float]]
                     ) -> dict[int, str]:
  """Process -> 'last to 7 of 9 calls, mean lag 1.20 ms' (the straggler statistic, per process).

  A process came last to a call when its lag was the largest (and not 0);
  its mean lag is over every call compared.
  """
  calls = sorted(set.intersection(*(set(v) for v in lags.values())))
  if len(lags) < 2 or not calls:
    return {}
  last = dict.fromkeys(lags, 0)
  for call in calls:
    worst = max(lags, key=lambda p: lags[p][call])
    if lags[worst][call] > 0:
      last[worst] += 1
  return {p: f'last to {last[p]} of {len(calls)} calls, mean lag '
             f'{sum(lags[p][c] for c in calls) / len(calls) * 1e3:.2f} ms'
          for p in lags}


def build(dumps: Sequence[Mapping[str, Any]], *, num_processes: int,
          failures: Mapping[int, Mapping[str, Any]] | None = None,
          attempts: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
  """The Chrome trace-event JSON object of a run (see the module docstring).

  Args:
    dumps: every process's dumps (of every attempt: each has 'attempt').
    num_processes: the job's process count (one track each).
    failures: process -> {'stopped': wall time, 'how': ..., 'last_line':
      ..., 'attempt': k} for the processes that failed.
    attempts: the launcher's attempts, {'start', 'end', 'cause', 'stopped'}
      (wall; 'stopped': the processes the launcher stopped, without a dump).

  Returns:
    {'traceEvents': [...], 'displayTimeUnit': 'ms', 'otherData': {...}}.
  """
  failures = failures or {}
  by_attempt: dict[int, list[Mapping[str, Any]]] = {}
  for d in dumps:
    by_attempt.setdefault(d.get('attempt', 0), []).append(d)
  offsets = {k: clock_offsets(ds) for k, ds in by_attempt.items()}
  def offset(d):
    return offsets[d.get('attempt', 0)].get(d['process'], 0.0)

  times = [r['start'] - offset(d) for d in dumps for r in d['records']]
  times += [e['start'] - offset(d) for d in dumps for e in d['events']]
  times += [a['start'] for a in attempts]
  times += [f['stopped'] for f in failures.values() if f.get('stopped')]
  t0 = min(times, default=0.0)

  def us(t: float, shift: float = 0.0) -> float:
    return round((t - shift - t0) * 1e6, 1)

  events = _tracks(num_processes)
  divergences = {}
  for attempt, ds in sorted(by_attempt.items()):
    events += _attempt_events(ds, attempt, offsets[attempt], us)
    line = divergence(ds, num_processes)
    if line is not None:
      divergences[attempt] = line
  events += _failure_events(failures, by_attempt, us)
  events += _launcher_events(attempts, num_processes, us)
  return {'traceEvents': events, 'displayTimeUnit': 'ms',
          'otherData': {'clock_offsets_s': {
              f'attempt {k}': {str(p): o for p, o in v.items()}
              for k, v in offsets.items()},
                        'divergence': {str(k): v for k, v in
                                       divergences.items()},
                        'start_unix_s': t0}}


def _tracks(num_processes: int) -> list[dict[str, Any]]:
  """The metadata events that name each process's track and its two threads."""
  events: list[dict[str, Any]] = []
  for p in range(num_processes):
    events.append({'ph': 'M', 'name': 'process_name', 'pid': p,
                   'args': {'name': f'process {p}'}})
    events.append({'ph': 'M', 'name': 'process_sort_index', 'pid': p,
                   'args': {'sort_index': p}})
    for tid, name in ((COLLECTIVES_TID, 'collectives'),
                      (EVENTS_TID, 'events')):
      events.append({'ph': 'M', 'name': 'thread_name', 'pid': p, 'tid': tid,
                     'args': {'name': name}})
  return events


def _attempt_events(ds: Sequence[Mapping[str, Any]], attempt: int,
                    shift: Mapping[int, float],
                    us: Callable[..., float]) -> list[dict[str, Any]]:
  """One attempt's events: each process's calls, their arrival lags and its events; the stragglers' labels."""
  events: list[dict[str, Any]] = []
  lags = straggler_lags(ds)
  for d in ds:
    p = d['process']
    off = shift.get(p, 0.0)
    for r in d['records']:
      last = r['done'] or r['end'] or d.get('dumped') or r['start']
      wait = (r['end'] or last) - r['start']
      args = {'op': r['op'], 'name': r['name'], 'call': r['call'],
              'bytes': r['nbytes'], 'wait_ms': round(wait * 1e3, 3),
              'move_ms': round((last - (r['end'] or last)) * 1e3, 3),
              'attempt': attempt}
      if r['end'] is None:
        args['completed'] = False
      if r.get('error'):
        args['error'] = r['error']
      events.append({'ph': 'X', 'cat': 'collective', 'name': _label(r),
                     'pid': p, 'tid': COLLECTIVES_TID,
                     'ts': us(r['start'], off),
                     'dur': round(max(last - r['start'], 0.0) * 1e6, 1),
                     'args': args})
      lag = lags.get(p, {}).get(r['call'])
      if lag is not None:
        events.append({'ph': 'C', 'name': 'arrival lag (ms)', 'pid': p,
                       'ts': us(r['start'], off),
                       'args': {'lag_ms': round(lag * 1e3, 3)}})
    for e in d['events']:
      events.append({'ph': 'X', 'cat': 'event', 'name': e['name'],
                     'pid': p, 'tid': EVENTS_TID, 'ts': us(e['start'], off),
                     'dur': round(max(e['end'] - e['start'], 0.0) * 1e6, 1),
                     'args': dict(e['args'], attempt=attempt)})
  for p, label in straggler_labels(lags).items():
    events.append({'ph': 'M', 'name': 'process_labels', 'pid': p,
                   'args': {'labels': f'attempt {attempt}: {label}'}})
  return events


def _failure_events(failures: Mapping[int, Mapping[str, Any]],
                    by_attempt: Mapping[int, Sequence[Mapping[str, Any]]],
                    us: Callable[..., float]) -> list[dict[str, Any]]:
  """An instant event per failed process: how, its last line, and what the others saw of it."""
  events: list[dict[str, Any]] = []
  for p, f in sorted(failures.items()):
    attempt = f.get('attempt', 0)
    args = {'how': f.get('how', ''), 'last_line': f.get('last_line', ''),
            'attempt': attempt, 'dumped': any(
                d['process'] == p for d in by_attempt.get(attempt, ()))}
    seen = last_seen(by_attempt.get(attempt, ()), p)
    if seen:
      args['seen_by_others'] = seen
    events.append({'ph': 'i', 's': 'p', 'cat': 'failure',
                   'name': f'process {p} stopped: {f.get("how", "failed")}',
                   'pid': p, 'tid': COLLECTIVES_TID,
                   'ts': us(f['stopped']) if f.get('stopped') else 0.0,
                   'args': args})
  return events


def _launcher_events(attempts: Sequence[Mapping[str, Any]],
                     num_processes: int,
                     us: Callable[..., float]) -> list[dict[str, Any]]:
  """The launcher's track (after the processes'): one span per attempt, with its cause."""
  if not attempts:
    return []
  launcher = num_processes
  events: list[dict[str, Any]] = [
      {'ph': 'M', 'name': 'process_name', 'pid': launcher,
       'args': {'name': 'launcher'}}]
  for k, a in enumerate(attempts):
    events.append({'ph': 'X', 'cat': 'attempt',
                   'name': f'attempt {k}' + (' (restart)' if k else ''),
                   'pid': launcher, 'tid': 0, 'ts': us(a['start']),
                   'dur': round(max(a['end'] - a['start'], 0.0) * 1e6, 1),
                   'args': {'cause': a.get('cause', ''),
                            'stopped_by_launcher': list(
                                a.get('stopped', ()))}})
  return events
