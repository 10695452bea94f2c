"""Smoke test of bin/bench.py: a tiny run at 2 controllers, its JSON rows."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import statistics
import sys

from multihost import launch

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = str(ROOT / 'bin' / 'bench.py')
KEYS = ('op', 'payload_bytes', 'leaves', 'processes', 'ours_ms', 'jax_ms',
        'ratio', 'ours_first_ms', 'jax_first_ms')


def _positive(row, key):
  value = row[key]
  assert isinstance(value, (int, float)) and value > 0 and math.isfinite(
      value), f'{key}={value!r} in {row}'


def test_quick_run_at_two_processes_writes_every_row(tmp_path):
  out = tmp_path / 'bench.jsonl'
  result = launch.launch(
      [sys.executable, BENCH, '--quick', '--recovery', f'--json={out}',
       f'--recovery_dir={tmp_path}', '--small_repeats=4'],
      num_processes=2, devices_per_process=1, timeout=55, cwd=ROOT)
  assert result.ok, result.summary + '\n' + result.outputs[0][-3000:]
  # Process 0 prints the markdown table.
  assert ('| op | payload | ours = jax | ours ms | jax ms | ours/jax |'
          in result.outputs[0])
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  for row in rows:
    assert set(KEYS) <= set(row), row
    assert row['processes'] == 2, row

  compare = [r for r in rows if r['kind'] == 'compare']
  ops = {r['op'] for r in compare}
  assert ops >= {'sync_global_devices', 'broadcast_one_to_all',
                 'process_allgather', 'assert_equal',
                 'process_allgather(tiled)'}, ops
  payloads = {(r['op'], r['payload_bytes'], r['leaves']) for r in compare}
  assert ('broadcast_one_to_all', 8, 1) in payloads
  assert ('process_allgather', 1024, 1) in payloads
  assert ('assert_equal', 80, 10) in payloads  # --quick: 10 leaves x 8 B.
  for row in compare:
    for key in ('ours_ms', 'ours_first_ms'):
      _positive(row, key)
    if row['jax_ms'] is None:
      # Only JAX's own failures are n/a, and the table says why, or the case
      # has no JAX equivalent (the mismatch: ours alone).
      assert 'jax n/a' in row['note'] or 'alone' in row['note'], row
    else:
      for key in ('jax_ms', 'jax_first_ms', 'ratio'):
        _positive(row, key)
      # Recomputed from the raw per-iteration times (slowest process each):
      # the medians, and the ratio of the medians.
      ours = statistics.median(row['ours_times_ms'])
      theirs = statistics.median(row['jax_times_ms'])
      # --quick: 3 samples; one leaf (or none) of at most 1 MiB: 4.
      small = row['leaves'] <= 1 and row['payload_bytes'] <= 1 << 20
      assert (len(row['ours_times_ms']) == len(row['jax_times_ms'])
              == (4 if small else 3)), row
      assert math.isclose(row['ours_ms'], ours), row
      assert math.isclose(row['jax_ms'], theirs), row
      assert math.isclose(row['ratio'], ours / theirs), row
    # Every comparable case was compared, and ours gave JAX's output.
    if row['jax_ms'] is not None or 'alone' in row['note']:
      assert row['outputs_equal'] is True, row
  assert {'broadcast_object', 'allgather_object',
          'broadcast_one_to_all(is_source=last)'} <= ops, ops
  assert any('late' in r['payload'] for r in compare), compare
  mismatch = [r for r in compare if 'mismatched' in r['payload']]
  assert len(mismatch) == 1 and mismatch[0]['outputs_equal'], mismatch

  refs = {r['op']: r for r in rows if r['kind'] == 'reference'}
  for name in ('coordination service wait_at_barrier',
               'loopback TCP, process 0 -> 1'):
    _positive(refs[name], 'ref_ms')

  recovery = [r for r in rows if r['kind'] == 'recovery']
  assert len(recovery) == 6, recovery  # Replicated and sharded states.
  assert {r['payload'].rsplit(', ', 1)[1] for r in recovery} == {
      'replicated', 'sharded'}, recovery
  for row in recovery:
    for key in ('ours_ms', 'jax_ms', 'ratio', 'ours_first_ms',
                'jax_first_ms'):
      _positive(row, key)
  # The checkpoint folders were removed.
  assert not list(tmp_path.glob('multihost-bench-*'))


def test_an_output_mismatch_fails_the_run(tmp_path):
  result = launch.launch(
      [sys.executable, BENCH, '--break_ours', '--ops=broadcast_one_to_all',
       '--sizes=8', '--leaves=0', '--repeats=1', '--small_repeats=1',
       '--warmup=0', '--nomemory',
       f'--json={tmp_path / "b.jsonl"}'],
      num_processes=2, devices_per_process=1, timeout=55, cwd=ROOT)
  assert not result.ok and list(result.returncodes) == [1, 1], result.summary
  assert 'OUTPUT MISMATCH' in result.outputs[0], result.outputs[0][-3000:]
  assert '| **NO** |' in result.outputs[0], result.outputs[0][-3000:]


def test_inputs_on_the_device_are_compared_as_on_the_host(tmp_path):
  # --inputs=device: the arrays are jax.Arrays on each process's device (a
  # CPU device here; bench/one_gpu.sh runs it with a GPU), on both sides.
  out = tmp_path / 'b.jsonl'
  result = launch.launch(
      [sys.executable, BENCH, '--inputs=device',
       '--ops=broadcast_one_to_all,process_allgather', '--sizes=8,2MiB',
       '--leaves=0', '--repeats=1', '--small_repeats=1', '--warmup=0',
       '--nomemory', f'--json={out}'],
      num_processes=2, devices_per_process=1, timeout=55, cwd=ROOT)
  assert result.ok, result.summary
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  compared = [(r['op'], r['payload'], r['outputs_equal']) for r in rows
              if r.get('kind') == 'compare']
  assert compared == [
      (op, f'{size} on cpu', True)
      for op in ('broadcast_one_to_all', 'process_allgather')
      for size in ('8 B', '2 MiB')], compared


def test_versus_and_soak_write_their_rows_and_the_targets(tmp_path):
  out = tmp_path / 'v.jsonl'
  result = launch.launch(
      [sys.executable, BENCH, '--ops=', '--versus=2', '--versus_sizes=8',
       '--soak=200', f'--json={out}'],
      num_processes=2, devices_per_process=1, timeout=55, cwd=ROOT)
  assert result.ok, result.summary + '\n' + result.outputs[0][-3000:]
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  versus = {r['op']: r for r in rows if r['kind'] == 'versus'}
  assert {'barrier', 'broadcast 8 B', 'all-gather 8 B',
          'raw TCP stream 64 MiB',
          'round trip 8 B (Python ping-pong, loopback)'} <= set(versus), versus
  # A round trip of 8 bytes on loopback takes microseconds, not nothing.
  assert 0 < versus['round trip 8 B (Python ping-pong, loopback)'][
      'ours_ms'] < 50, versus
  for row in versus.values():
    assert len(row['ours_times_ms']) == 2, row
    assert math.isclose(row['ours_ms'], statistics.median(
        row['ours_times_ms'])), row
  soak = [r for r in rows if r['kind'] == 'soak']
  assert [r['calls'] for r in soak] == [2, 20, 50, 100, 150, 200], soak
  for r in soak:
    assert len(r['processes']) == 2, r
    for s in r['processes']:
      assert s['rss'] > 0 and s['fds'] > 0 and s['threads'] > 0, s
  text = result.outputs[0]
  assert '| target (P=2) | measured' in text, text[-3000:]
  assert '| soak: fds constant (calls 20 -> 200) |' in text, text[-3000:]
  # 64 MiB was not run: its targets say so rather than met or missed.
  assert '| broadcast 64 MiB <= torch gloo | n/a | not measured |' in text


def test_versus_times_one_side_alone(tmp_path):
  """--versus_side=ours times ours without torch; =torch times torch gloo's alone (or says torch is missing)."""
  def run(side):
    out = tmp_path / f'{side}.jsonl'
    result = launch.launch(
        [sys.executable, BENCH, '--ops=', '--versus=2', '--versus_sizes=8',
         f'--versus_side={side}', '--nomemory', f'--json={out}'],
        num_processes=2, devices_per_process=1, timeout=55, cwd=ROOT)
    rows = ([json.loads(line) for line in out.read_text().splitlines()]
            if out.exists() else [])
    return result, {r['op']: r for r in rows if r['kind'] == 'versus'}

  result, ours = run('ours')
  assert result.ok, result.summary + '\n' + result.outputs[0][-3000:]
  assert {'barrier', 'broadcast 8 B', 'raw TCP stream 64 MiB'} <= set(ours)
  for row in ours.values():
    assert len(row['ours_times_ms']) == 2 and row['torch_times_ms'] is None, row
  result, torch = run('torch')
  if importlib.util.find_spec('torch') is None:
    assert not result.ok, result.summary
    assert 'torch is not importable on every process' in result.outputs[0], (
        result.outputs[0][-3000:])
    return
  assert result.ok, result.summary + '\n' + result.outputs[0][-3000:]
  # Only the compared cases: the raw streams and round trips are ours.
  assert set(torch) == {'barrier', 'broadcast 8 B', 'all-gather 8 B',
                        'exchange (ring) 8 B', 'all-gather of a small object',
                        'broadcast of a 1 KiB object'}, torch
  for row in torch.values():
    assert row['ours_times_ms'] == [] and row['ours_ms'] is None, row
    assert len(row['torch_times_ms']) == 2 and row['torch_ms'] > 0, row


def test_versus_times_only_the_chosen_cases_busy(tmp_path):
  """--versus_ops and --noversus_idle (as `--report_cases=contended` runs them): only the busy broadcast row."""
  out = tmp_path / 'busy.jsonl'
  result = launch.launch(
      [sys.executable, BENCH, '--ops=', '--versus=1', '--versus_sizes=8',
       '--versus_ops=broadcast', '--versus_busy', '--noversus_idle',
       '--versus_side=ours', '--nomemory', f'--json={out}'],
      num_processes=2, devices_per_process=1, timeout=55, cwd=ROOT)
  assert result.ok, result.summary + '\n' + result.outputs[0][-3000:]
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r['op'] for r in rows if r['kind'] == 'versus'] == [
      'broadcast 8 B (CPU busy)'], rows


def test_targets_mark_met_and_missed_from_the_medians():
  sys.path.insert(0, str(ROOT))
  from bench import model
  from bench import reference
  from bench import soak
  from bench import versus
  r = versus.Result
  results = [r('barrier', 0, [1.0, 3.0, 2.0], [2.5, 2.5, 2.5]),
             r('broadcast 64 MiB', 1, [20.0], [19.0]),
             r('raw TCP stream 64 MiB', 1, [16.0], None),
             r('all-gather 64 MiB', 1, [50.0], [100.0])]
  rows = {t: (m, s) for t, m, s in versus.targets(results)}
  assert rows['barrier <= torch gloo'] == ('2.00 vs 2.50 ms = 0.80x', 'met')
  assert rows['broadcast 64 MiB <= torch gloo'][1] == 'missed'
  assert rows['broadcast 64 MiB <= 1.3x a raw stream'] == (
      '20.0 vs 16.0 ms = 1.25x', 'met')
  assert rows['all-gather 64 MiB <= 0.5x torch gloo'][1] == 'met'
  assert rows['broadcast 8 B <= torch gloo'] == ('n/a', 'not measured')
  assert rows['barrier, CPU busy <= torch gloo'] == ('n/a', 'not measured')
  floor = reference.RoundTrip.NAME
  rows = {t: (m, s) for t, m, s in versus.targets(
      [r('barrier', 0, [0.3], [0.4]), r(floor, 8, [0.1], None),
       r('broadcast 8 B', 8, [0.5], [0.6]),
       r('barrier (CPU busy)', 0, [0.5], [0.4])])}
  assert rows['barrier <= 3x one round trip'] == ('0.30 vs 0.10 ms = 3.00x',
                                                   'met')
  assert rows['broadcast 8 B <= 4x one round trip'][1] == 'missed'
  assert rows['barrier, CPU busy <= torch gloo'] == (
      '0.50 vs 0.40 ms = 1.25x', 'missed')
  mib = 1 << 20
  def point(calls, rss1, fds1=9):
    return {'calls': calls, 'seconds': 0, 'processes': [
        {'rss': 100 * mib, 'fds': 9, 'threads': 5},
        {'rss': rss1, 'fds': fds1, 'threads': 5}]}
  grew = {t: s for t, _, s in soak.targets(
      [point(1000, 90 * mib), point(10000, 90 * mib),
       point(100000, 95 * mib, fds1=10)])}
  assert list(grew.values()) == ['missed', 'missed', 'met', 'met'], grew
  flat = {t: s for t, _, s in soak.targets(
      [point(10000, 90 * mib), point(100000, 94 * mib)])}
  assert list(flat.values()) == ['met'] * 4, flat
  text = model.render(model.rows())
  assert '| 1024 | agreement over TCP links (dissemination) | 10 |' in text
  assert '| 4096 | agreement over TCP links (dissemination) | 12 |' in text
  assert '| 4096 | agreement at the service (full exchange) | 3 |' in text


COST_CASES = ['round trip (local socket)', 'round trip, socket timeout',
              'framed round trip', 'barrier', 'broadcast 8 B',
              'all-gather 8 B']


def test_cost_times_every_layer_from_the_round_trip_up(tmp_path):
  out = tmp_path / 'cost.json'
  result = launch.launch(
      [sys.executable, str(ROOT / 'bench' / 'cost.py'), '--calls=40',
       '--rounds=2', f'--json={out}'],
      num_processes=2, devices_per_process=1, timeout=60, cwd=ROOT)
  assert result.ok, result.summary + '\n' + result.outputs[0][-3000:]
  report = json.loads(out.read_text())
  assert [row['case'] for row in report['rows']] == COST_CASES, report
  for row in report['rows']:
    _positive(row, 'wall_ms')
    assert len(row['cpu_ms']) == len(row['sleeps']) == 2, row
    assert all(cpu > 0 for cpu in row['cpu_ms']), row
    assert all(sleeps >= 0 for sleeps in row['sleeps']), row
  # A round trip's reply cannot come before its message: some reads wait
  # (how many depends on the load; under a full suite's, fewer than half).
  assert any(max(row['sleeps']) > 0 for row in report['rows'][:3]), report
  for case in COST_CASES:
    assert f'| {case} | ' in result.outputs[0], case


def test_cpu_share_sums_every_process_s_cpu_per_call_at_three(tmp_path):
  out = tmp_path / 'cpu.json'
  result = launch.launch(
      [sys.executable, str(ROOT / 'bench' / 'cpu_share.py'), '--calls=5',
       '--rounds=2', '--no-torch', '--ops=barrier,broadcast,all-gather',
       '--sizes=8,1MiB', f'--json={out}'],
      num_processes=3, devices_per_process=1, timeout=90, cwd=ROOT)
  assert result.ok, result.summary + '\n' + result.outputs[0][-3000:]
  report = json.loads(out.read_text())
  assert report['processes'] == 3, report
  names = [row['case'] for row in report['rows']]
  assert names == ['barrier', 'broadcast 8 B', 'all-gather 8 B',
                   'broadcast 1 MiB', 'all-gather 1 MiB'], names
  for row in report['rows']:
    assert row['side'] == 'ours', row  # (--no-torch)
    _positive(row, 'wall_ms')
    assert len(row['cpu_ms']) == len(row['sleeps']) == 3, row
    assert all(cpu > 0 for cpu in row['cpu_ms']), row
    assert math.isclose(row['cpu_total_ms'], sum(row['cpu_ms'])), row
    assert f"| {row['case']} | ours | " in result.outputs[0], row
  # Moving a MiB costs every process more CPU than moving 8 bytes.
  by_case = {row['case']: row for row in report['rows']}
  assert (by_case['broadcast 1 MiB']['cpu_total_ms']
          > by_case['broadcast 8 B']['cpu_total_ms']), by_case


_BUSY_PROGRAM = '''
import os, sys
sys.path.insert(0, {root!r})
import jax
import multihost
multihost.initialize()
from bench.harness import Settings
from bench.reference import BusyCores
for placement in BusyCores.PLACEMENTS:
  busy = BusyCores(Settings(timeout=30), placement)
  try:
    sessions = sorted({{os.getsid(p.pid) for p in busy.procs}})
    print(f'BUSY {{placement}} p{{jax.process_index()}} '
          f'spinners={{len(busy.procs)}} '
          f'own_session={{sessions == [os.getsid(0)]}}', flush=True)
  finally:
    busy.close()
'''


def test_busy_cores_spin_beside_every_process_or_process_0_alone(tmp_path):
  # The kernel shares the cores between sessions first (autogroup), and
  # the launcher gives every controller its own: each process's spinners
  # are its children, in its session, one per core in all.
  cores = os.cpu_count() or 1
  program = tmp_path / 'busy.py'
  program.write_text(_BUSY_PROGRAM.format(root=str(ROOT)))
  result = launch.launch([sys.executable, str(program)], num_processes=2,
                         devices_per_process=1, timeout=55, cwd=ROOT)
  assert result.ok, result.summary + '\n' + result.outputs[0][-3000:]
  for placement, want in (('every_process',
                           [len(range(p, cores, 2)) for p in (0, 1)]),
                          ('process_0', [cores, 0])):
    for p in (0, 1):
      line = next(x for x in result.outputs[p].splitlines()
                  if f'BUSY {placement} ' in x)
      assert f'spinners={want[p]} ' in line, line
      if want[p]:
        assert 'own_session=True' in line, line


def test_restore_reads_counts_the_storage_bytes_of_each_mode():
  out = _script('restore_reads.py', '--processes=2', '--mb=2',
                '--repeats=1')
  rows = [json.loads(line) for line in out.splitlines()
          if line.startswith('{')]
  once, every = rows
  assert once['read_once'] and not every['read_once']
  assert once['bits_equal'] and every['bits_equal']
  assert 0.8 <= once['storage_per_job'] <= 1.25, once
  assert every['storage_per_job'] >= 1.6, every
  assert '| 2 | once |' in out and '| 2 | every |' in out


def test_scale_costs_counts_bytes_and_sockets_per_call(tmp_path):
  out = tmp_path / 'costs.jsonl'
  table = _script('scale_costs.py', '--processes=2', '--calls=1',
                  '--hosts=', '--only=broadcast_one_to_all 1 MiB,sync',
                  f'--out={out}')
  rows = {r['case']: r for r in map(json.loads, out.read_text().splitlines())}
  big = rows['broadcast_one_to_all 1 MiB']
  # Process 0 sends the MiB, process 1 receives it: each moves about 1 MiB.
  assert 1 << 20 <= big['bytes_p0'] <= 1.1 * (1 << 20), big
  assert 0 < rows['sync_global_devices']['bytes_max'] < 4096, rows
  assert rows['memory']['tcp_sockets'] == [2, 2], rows['memory']
  assert '| broadcast_one_to_all 1 MiB |' in table


def _script(name: str, *args: str) -> str:
  import subprocess  # pylint: disable=import-outside-toplevel
  done = subprocess.run([sys.executable, str(ROOT / 'bench' / name), *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return done.stdout
