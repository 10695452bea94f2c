"""The timeline in one process: flight records in a bounded ring, their merge into one Chrome trace, the first divergence, clock offsets per attempt, and the metrics through jax.monitoring."""

from __future__ import annotations

import json

from jax import monitoring
import numpy as np
import pytest

import multihost
from multihost import env as env_lib
from multihost._src.diagnostics import metrics
from multihost._src.diagnostics import trace_format
from multihost._src.runtime import flight


def _record(call, op='sync_global_devices', name='', start=0.0, end=None,
            done=None, nbytes=0):
  return {'op': op, 'name': name, 'call': call, 'start': start, 'end': end,
          'done': done, 'nbytes': nbytes, 'error': ''}


def _dump(process, records, events=(), attempt=0):
  return {'process': process, 'records': list(records),
          'events': list(events), 'attempt': attempt, 'dumped': 100.0}


def _agreed(process, calls, shift=0.0):
  return _dump(process, [_record(c, name=f's{c}', start=c + shift,
                                 end=c + 0.5 + shift, done=c + 0.6 + shift)
                         for c in calls])


# --- The divergence (pure) ---------------------------------------------------

def test_no_divergence_when_every_call_agreed_and_completed():
  assert trace_format.divergence([_agreed(0, range(5)),
                                   _agreed(1, range(5))], 2) is None


def test_divergence_names_the_first_call_with_different_names():
  a = _agreed(0, range(5))
  b = _agreed(1, range(5))
  b['records'][3]['name'] = 'other'
  b['records'][4]['op'] = 'process_allgather'
  line = trace_format.divergence([a, b], 2)
  assert line == ("divergence: at call 3 the processes disagreed: processes "
                  "[0] ran sync_global_devices('s3'); processes [1] ran "
                  "sync_global_devices('other').")


def test_divergence_names_the_process_that_stopped_arriving():
  a = _agreed(0, range(4))
  a['records'].append(_record(4, name='after', start=4.0, done=7.0))
  b = _agreed(1, range(4))
  line = trace_format.divergence([a, b], 3)  # process 2 left no dump
  assert line == ("divergence: at call 4 (sync_global_devices('after')) "
                  "processes [1, 2] stopped arriving; processes [0] waited "
                  "3.0 s for them.")


def test_clock_offsets_are_the_median_of_barrier_exits():
  a = _agreed(0, range(9))
  b = _agreed(1, range(9), shift=2.0)
  b['records'][0]['end'] += 5  # one outlier does not move the median
  assert trace_format.clock_offsets([a, b]) == {0: 0.0, 1: 2.0}


def test_the_merged_trace_aligns_clocks_and_marks_the_failed_process():
  a = _agreed(0, range(3))
  a['records'].append(_record(3, name='after', start=3.0, done=4.0))
  a['events'].append({'name': 'checkpoint save', 'start': 0.1, 'end': 0.2,
                      'args': {'step': 1}})
  b = _agreed(1, range(3), shift=10.0)
  b['records'] = b['records'][:3]
  trace = trace_format.build(
      [a, b], num_processes=2,
      failures={1: {'stopped': 3.2, 'how': 'killed by SIGKILL',
                    'last_line': 'ROUND 2'}})
  events = trace['traceEvents']
  json.dumps(trace)  # plain JSON
  x = {(e['pid'], e['args']['call']): e for e in events
       if e['ph'] == 'X' and e['cat'] == 'collective'}
  assert sorted(x) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1),
                       (1, 2)]
  assert x[(0, 1)]['ts'] == x[(1, 1)]['ts']  # 10 s offset removed
  assert x[(0, 1)]['dur'] == 600000.0
  assert x[(0, 1)]['args']['wait_ms'] == 500.0
  assert x[(0, 1)]['args']['move_ms'] == pytest.approx(100.0)
  assert x[(0, 3)]['args']['completed'] is False
  (mark,) = [e for e in events if e['ph'] == 'i']
  assert mark['pid'] == 1 and 'SIGKILL' in mark['name']
  assert mark['args']['seen_by_others'] == (
      "last completed call 2 (sync_global_devices('s2')); never arrived at "
      "call 3 (sync_global_devices('after'))")
  assert [e['name'] for e in events if e.get('cat') == 'event'] == [
      'checkpoint save']
  # Process 0 waited 0.5 s at every call, process 1 too: no one came last.
  labels = {e['pid']: e['args']['labels'] for e in events
            if e['name'] == 'process_labels'}
  assert labels == {0: 'attempt 0: last to 0 of 3 calls, mean lag 0.00 ms',
                    1: 'attempt 0: last to 0 of 3 calls, mean lag 0.00 ms'}


def test_each_attempt_aligns_clocks_with_its_own_offsets():
  """Clock offsets come from each attempt's dumps alone: a restart's different skew (same call numbers) aligns its own calls."""
  dumps = [_agreed(0, range(3)), _agreed(1, range(3), shift=10.0),
           _agreed(0, range(3), shift=50.0), _agreed(1, range(3), shift=50.0)]
  for d in dumps[2:]:  # The restart: call numbers from 0 again.
    d['attempt'] = 1
  trace = trace_format.build(dumps, num_processes=2)
  assert trace['otherData']['clock_offsets_s'] == {
      'attempt 0': {'0': 0.0, '1': 10.0}, 'attempt 1': {'0': 0.0, '1': 0.0}}
  x = {(e['args']['attempt'], e['pid'], e['args']['call']): e['ts']
       for e in trace['traceEvents']
       if e['ph'] == 'X' and e['cat'] == 'collective'}
  assert len(x) == 12
  for attempt in (0, 1):
    for call in range(3):
      assert x[(attempt, 0, call)] == x[(attempt, 1, call)], (attempt, call)
  assert x[(1, 0, 0)] - x[(0, 0, 0)] == 50e6  # the restart came 50 s later


def test_the_straggler_statistic_per_process():
  a = _agreed(0, range(4))
  b = _agreed(1, range(4))
  for r in b['records'][:3]:
    r['start'] += 0.2  # came 0.2 s late to calls 0-2: waited 0.2 s less
  lags = trace_format.straggler_lags([a, b])
  assert lags[1] == pytest.approx({0: 0.2, 1: 0.2, 2: 0.2, 3: 0.0})
  assert trace_format.straggler_labels(lags) == {
      0: 'last to 0 of 4 calls, mean lag 0.00 ms',
      1: 'last to 3 of 4 calls, mean lag 150.00 ms'}


# --- The recorder ------------------------------------------------------------

def test_the_ring_is_bounded_and_its_size_configurable(monkeypatch):
  monkeypatch.setenv(env_lib.FLIGHT_RING, '5')
  recorder = flight.Recorder()
  for call in range(12):
    recorder.begin('op', call, float(call))
    recorder.event('e', 0.0, 1.0, {})
  assert [r.call for r in recorder.records()] == [7, 8, 9, 10, 11]
  assert len(recorder.events()) == 5
  assert [r.call for r in recorder.since(9)] == [9, 10, 11]
  monkeypatch.setenv(env_lib.FLIGHT_RING, 'many')
  with pytest.raises(ValueError, match='MULTIHOST_FLIGHT_RING'):
    flight.Recorder()


def test_a_call_that_raised_after_its_meeting_says_when():
  # E.g. a broadcast whose processes met, then whose transfer failed: the
  # where-responder reads `failed_at` of a call marked as raised.
  recorder = flight.Recorder()
  record = recorder.begin('broadcast_one_to_all', 1, 10.0)
  flight.Recorder.end(record)
  metrics._finish(recorder, 'broadcast_one_to_all', 0, 10.0, 0,
                   'CollectiveTimeoutError')
  failed = recorder.last_failed()
  assert failed is record and failed.error == 'CollectiveTimeoutError'
  assert failed.failed_at is not None and failed.failed_at >= record.end


# --- Metrics -----------------------------------------------------------------

@pytest.fixture
def listened():
  durations, scalars = [], []

  def on_duration(event, seconds, **meta):
    durations.append((event, seconds, meta))

  def on_scalar(event, value, **meta):
    scalars.append((event, value, meta))

  monitoring.register_event_duration_secs_listener(on_duration)
  monitoring.register_scalar_listener(on_scalar)
  yield durations, scalars
  monitoring.unregister_event_duration_listener(on_duration)
  monitoring.unregister_scalar_listener(on_scalar)


def test_sixteen_calls_in_one_process_give_sixteen_durations(listened):
  durations, scalars = listened
  for k in range(8):
    multihost.broadcast_one_to_all(np.arange(4, dtype=np.int32))
    multihost.sync_global_devices(f'step {k}')
  mine = [(s, m) for e, s, m in durations if e == metrics.DURATION]
  assert len(mine) >= 16
  assert {m['op'] for _, m in mine} == {'broadcast_one_to_all',
                                        'sync_global_devices'}
  assert all(s >= 0 for s, _ in mine)
  sizes = [(v, m['op']) for e, v, m in scalars if e == metrics.BYTES]
  assert sizes.count((16, 'broadcast_one_to_all')) == 8


def test_record_event_reports_its_duration_tier_and_bytes(listened):
  durations, scalars = listened
  multihost.record_event('checkpoint restore', 1.0, 3.5, step=4,
                         tier='local', bytes=1024)
  assert (metrics.EVENT, 2.5, {'name': 'checkpoint restore'}) in durations
  assert (metrics.EVENT_BYTES, 1024,
          {'name': 'checkpoint restore', 'tier': 'local'}) in scalars


def test_a_straggler_matters_only_relative_to_the_step():
  report = multihost.StragglerReport(
      calls=10, last_counts=(0, 10), skew_when_last=(0.0, 0.0004),
      mean_skew=0.0004, max_skew=0.001, consistently_last=1)
  assert not report.matters(step_seconds=0.001)  # sub-millisecond noise
  slow = multihost.StragglerReport(
      calls=10, last_counts=(0, 10), skew_when_last=(0.0, 0.05),
      mean_skew=0.05, max_skew=0.06, consistently_last=1)
  assert slow.matters(step_seconds=0.5)
  assert not slow.matters(step_seconds=10.0)  # 0.5% of a step


# --- Real runs ---------------------------------------------------------------


# --- Finding 7: a trace that cannot be written is named as such ---------------


