"""The timeline of real runs: `launch --trace` merges every controller's flight recorder (a SIGKILL, restarts, a trace file that cannot be written)."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

from _helpers import program

from multihost import env as env_lib
from multihost import launch

# --- The divergence (pure) ---------------------------------------------------


# --- The recorder ------------------------------------------------------------


# --- Metrics -----------------------------------------------------------------


# --- Real runs ---------------------------------------------------------------

def _collectives(trace):
  by_process = {}
  for e in trace['traceEvents']:
    if e['ph'] == 'X' and e['cat'] == 'collective':
      by_process.setdefault(e['pid'], []).append(e['args']['call'])
  return by_process


def _check_format(trace, num_processes):
  """What a trace-event viewer needs: the fields and their types."""
  assert isinstance(trace['traceEvents'], list)
  names = {e['pid']: e['args']['name'] for e in trace['traceEvents']
           if e['ph'] == 'M' and e['name'] == 'process_name'}
  assert [names[p] for p in range(num_processes)] == [
      f'process {p}' for p in range(num_processes)]
  for e in trace['traceEvents']:
    assert e['ph'] in ('X', 'M', 'C', 'i'), e
    assert isinstance(e['pid'], int)
    if e['ph'] != 'M':
      assert isinstance(e['ts'], float) and e['ts'] >= 0, e
    if e['ph'] == 'X':
      assert isinstance(e['tid'], int) and e['dur'] >= 0, e


def test_a_two_process_run_gives_one_track_each_and_one_event_per_call(
    tmp_path):
  path = tmp_path / 'run.json'
  written = tmp_path / 'written.json'
  result = launch.launch(program('traced', 3, 'write', written),
                         num_processes=2, timeout=120, trace=path)
  assert result.ok, result.summary
  assert f'trace: {path}' in result.summary
  assert 'divergence' not in result.summary
  trace = json.loads(path.read_text())
  _check_format(trace, 2)
  # 3 rounds of 3 collectives, then write_trace's gather.
  assert {p: sorted(c) for p, c in _collectives(trace).items()} == {
      0: list(range(10)), 1: list(range(10))}
  calls = [e for e in trace['traceEvents']
           if e['ph'] == 'X' and e['cat'] == 'collective']
  by_op = {}
  for e in calls:
    by_op.setdefault(e['args']['op'], []).append(e)
  assert {e['args']['bytes'] for e in by_op['broadcast_one_to_all']} == {16}
  assert {e['args']['bytes'] for e in by_op['process_allgather']} == {16}
  # Moving data (and rebuilding the result) follows the meeting.
  assert all(e['args']['move_ms'] > 0 for e in by_op['broadcast_one_to_all'])
  assert all(e['dur'] >= e['args']['wait_ms'] * 1e3 - 1 for e in calls)
  saves = [e for e in trace['traceEvents'] if e['name'] == 'checkpoint save']
  assert sorted(e['pid'] for e in saves) == [0, 0, 0, 1, 1, 1]
  assert not [e for e in trace['traceEvents'] if e['ph'] == 'i']
  # The collective function: the same calls, before its own gather.
  assert 'WROTE None' in result.outputs[0]
  own = json.loads(written.read_text())
  _check_format(own, 2)
  assert {p: sorted(c) for p, c in _collectives(own).items()} == {
      0: list(range(9)), 1: list(range(9))}


def test_after_a_sigkill_the_trace_holds_the_survivors_and_marks_the_dead(
    tmp_path):
  path = tmp_path / 'run.json'
  result = launch.launch(program('traced', 3, 'die'), num_processes=2,
                         timeout=120, trace=path,
                         env={env_lib.HEARTBEAT: '3'})
  assert result.returncodes[1] == -9, result.summary
  assert ("divergence: at call 9 (sync_global_devices('after')) processes "
          "[1] stopped arriving") in result.summary
  # The killed process's own line: its last call and who waited for it.
  assert re.search(
      r"\ntrace: process 1 \(killed by SIGKILL \(status 137\)\), as the "
      r"others' records show: last completed call 8 \(process_allgather\); "
      r"never arrived at call 9 \(sync_global_devices\('after'\)\), where "
      r'processes \[0\] waited [\d.]+ s for it\.$', result.summary,
      re.M), result.summary
  trace = json.loads(path.read_text())
  _check_format(trace, 2)
  assert sorted(_collectives(trace)[0]) == list(range(10))  # the survivor
  assert 1 not in _collectives(trace)  # no dump from the killed process
  (mark,) = [e for e in trace['traceEvents']
             if e['ph'] == 'i' and e['pid'] == 1]
  assert 'killed by SIGKILL' in mark['name']
  assert mark['args']['last_line'] == 'ROUND 2'
  assert 'never arrived at call 9' in mark['args']['seen_by_others']


def test_restarts_appear_on_the_launcher_track_with_each_attempts_calls(
    tmp_path):
  path = tmp_path / 'run.json'
  result = launch.launch(program('traced', 1, 'die'), num_processes=2,
                         timeout=120, trace=path, max_restarts=1,
                         env={env_lib.HEARTBEAT: '3'})
  assert len(result.attempts) == 2, result.summary
  trace = json.loads(path.read_text())
  _check_format(trace, 2)
  attempts = [e for e in trace['traceEvents'] if e.get('cat') == 'attempt']
  assert [e['name'] for e in attempts] == ['attempt 0', 'attempt 1 (restart)']
  assert all(e['pid'] == 2 for e in attempts)  # the launcher's track
  assert attempts[0]['ts'] < attempts[1]['ts']
  survivor = sorted((e['args']['attempt'], e['args']['call'])
                    for e in trace['traceEvents']
                    if e.get('cat') == 'collective' and e['pid'] == 0)
  # Restarting at once, the launcher stopped the survivor of attempt 0
  # before it could dump (it was blocked on the dead peer): the span says so.
  assert attempts[0]['args']['stopped_by_launcher'] == [0], attempts[0]
  assert survivor == [(1, 0), (1, 1), (1, 2), (1, 3)]


# --- Finding 7: a trace that cannot be written is named as such ---------------

def test_a_failed_trace_write_keeps_the_runs_status_and_summary():
  """Was: `cannot run '/bin/sh': No such file or directory`, exit 127, no summary."""
  proc = subprocess.run(
      [sys.executable, '-m', 'multihost.launch', '--num_processes=2',
       '--trace=/nonexistent/dir/t.json', '--', '/bin/sh', '-c',
       'echo hi; exit 3'],
      capture_output=True, text=True, timeout=60,
      cwd=pathlib.Path(__file__).resolve().parents[2])
  assert proc.returncode == 3, proc.stderr
  assert '[p0] hi\n' in proc.stdout and '[p1] hi\n' in proc.stdout
  assert 'exit status 3.' in proc.stderr  # The summary's first line.
  assert 'First failure: process' in proc.stderr
  assert ('trace: could not write the trace file /nonexistent/dir/t.json '
          '(FileNotFoundError: No such file or directory)') in proc.stderr
  assert 'cannot run' not in proc.stderr
  # No controller initialized multihost: no dumps, nothing kept.
  assert 'nothing was kept' in proc.stderr


def test_a_failed_trace_write_keeps_the_controllers_dumps_and_says_where(
    tmp_path):
  path = tmp_path / 'missing' / 'run.json'
  result = launch.launch(program('traced', 1), num_processes=2, timeout=120,
                         trace=path)
  assert result.ok, result.summary
  (line,) = [x for x in result.summary.splitlines() if x.startswith('trace:')]
  assert line.startswith(f'trace: could not write the trace file {path} '
                         '(FileNotFoundError: No such file or directory)')
  folder = line.split('dumps are kept in ')[1].split(' ')[0]
  try:
    assert sorted(p.name for p in pathlib.Path(folder).iterdir()) == [
        'process-0.attempt-0.json', 'process-1.attempt-0.json']
  finally:
    shutil.rmtree(folder)
