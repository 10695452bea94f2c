"""bin/plot.py: what a training run, a benchmark run, a P-scaling report and the scale drill are drawn from, and the PNGs."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / 'bin'))
sys.path.insert(0, str(ROOT))
import _plot_drill  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import _plot_scaling  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import plot  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from bench import reference  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from bench import scaling  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from bench import versus  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

_PNG = b'\x89PNG\r\n\x1a\n'


def _write(path: pathlib.Path, records: list[dict], tail: str = '') -> None:
  path.write_text(''.join(json.dumps(r) + '\n' for r in records) + tail)


def test_a_step_that_goes_back_marks_a_resume_and_events_are_kept(tmp_path):
  records = ([{'step': s, 'loss': 1.0 / s} for s in range(1, 8)] +
             [{'event': 'restart', 'step': 5}] +
             [{'step': s, 'loss': 1.0 / s} for s in range(6, 10)] +
             [{'step': s, 'loss': 1.0 / s} for s in range(8, 11)])
  path = tmp_path / 'm.jsonl'
  _write(path, records, tail='{"step": 11, "lo')  # A writer killed mid-line.
  run = plot.training_run(plot.read_jsonl(str(path)))
  assert run.steps == list(range(1, 8)) + list(range(6, 10)) + [8, 9, 10]
  # The restart is marked where it was written, and not a second time; the
  # unmarked jump back from 9 to 8 is a resume from step 7.
  assert run.events == [('restart', 5, None), ('resume', 7, None)]


def test_a_broken_line_that_is_not_the_last_is_an_error(tmp_path):
  path = tmp_path / 'm.jsonl'
  path.write_text('{"step": 1, "loss": 1}\nnot json\n{"step": 2, "loss": 1}\n')
  with pytest.raises(ValueError, match=r'm.jsonl:2 is not JSON'):
    plot.read_jsonl(str(path))


def test_benchmark_rows_are_grouped_by_operation_and_implementation():
  rows = [
      {'op': 'broadcast_one_to_all', 'payload': '8 B', 'payload_bytes': 8,
       'leaves': 1, 'kind': 'compare', 'ours_ms': 0.5, 'jax_ms': 0.9},
      {'op': 'broadcast_one_to_all', 'payload': '100 leaves × 8 B',
       'payload_bytes': 800, 'leaves': 100, 'kind': 'compare',
       'ours_ms': 1.0, 'jax_ms': 16.0},
      {'op': 'broadcast_one_to_all', 'payload': '1 KiB, last process 5 ms '
       'late', 'payload_bytes': 1024, 'leaves': 1, 'kind': 'compare',
       'ours_ms': 6.0, 'jax_ms': 6.0},
      {'op': 'torch.distributed gloo broadcast', 'payload': '8 B',
       'payload_bytes': 8, 'leaves': 1, 'kind': 'reference', 'ref_ms': 0.2},
      {'op': 'loopback TCP, process 0 -> 1', 'payload': '64 MiB',
       'payload_bytes': 2**26, 'leaves': 1, 'kind': 'reference',
       'ref_ms': 20.0},
      {'op': 'sync_global_devices', 'payload': '–', 'payload_bytes': 0,
       'leaves': 0, 'kind': 'compare', 'ours_ms': 0.4, 'jax_ms': 0.9},
      {'op': 'torch.distributed gloo all_reduce', 'payload': '1 MiB',
       'payload_bytes': 2**20, 'leaves': 1, 'kind': 'reference',
       'ref_ms': 1.0},
  ]
  series = plot.bench_series(rows)
  assert series['broadcast'] == {
      'multihost': [(8, 0.5)],
      'jax.experimental.multihost_utils': [(8, 0.9)],
      'torch.distributed gloo': [(8, 0.2)],
      'raw TCP stream': [(2**26, 20.0)],
  }
  assert series['barrier'] == {
      'multihost': [(1, 0.4)], 'jax.experimental.multihost_utils': [(1, 0.9)]}
  assert set(series) == {'broadcast', 'barrier'}


def _scaling_report() -> dict:
  """What bench/scaling.py writes for a small report: P=2 (with a CPU-busy row) and P=4, where 64 MiB was not run."""
  r = versus.Result
  by_p = {
      2: [r('barrier', 0, [0.1, 0.3, 0.2], [0.5]),
          r('broadcast 8 B', 8, [0.2], [0.3]),
          r('broadcast 64 MiB', 64 << 20, [20.0, 22.0], [19.0, 21.0]),
          r('raw TCP stream 64 MiB', 64 << 20, [25.0], None),
          r(reference.RoundTrip.NAME, 8, [0.07], None),
          r(reference.RoundTrip.LOCAL_NAME, 8, [0.03], None),
          r('barrier' + versus.BUSY, 0, [0.9], [1.9]),
          r('barrier' + versus.OVER_TCP, 0, [0.3], [0.6])],
      4: [r('barrier', 0, [0.5], [1.5]),
          r('broadcast 8 B', 8, [0.7], [0.6]),
          r('raw TCP stream 64 MiB', 64 << 20, [29.0], None),
          r(reference.RoundTrip.NAME, 8, [0.09], None)],
  }
  return scaling.scaling_data(by_p, commit='abc1234', date='2026-12-03',
                              cores=2)


def test_a_scaling_report_gives_ours_and_torch_per_case_against_p(tmp_path):
  assert scaling.data_path('/tmp/report.md') == '/tmp/report.json'
  path = tmp_path / 'report.json'
  path.write_text(json.dumps(_scaling_report()))
  data = _plot_scaling.read_json(str(path))
  series = _plot_scaling.scaling_series(data)
  floor = [(2, 0.07), (4, 0.09)]
  # Cases in the report's order; the CPU-busy row, the links-over-TCP row
  # and the references are no case of their own. The round trips are the
  # floors of the small calls; the raw stream bounds the broadcast of its
  # size; a case not run at P=4 has no point there.
  assert series == {
      'barrier': {_plot_scaling.OURS: [(2, 0.2), (4, 0.5)],
                  _plot_scaling.TORCH: [(2, 0.5), (4, 1.5)],
                  _plot_scaling.OURS_TCP: [(2, 0.3)], _plot_scaling.FLOOR: floor,
                  _plot_scaling.FLOOR_LOCAL: [(2, 0.03)]},
      'broadcast 8 B': {_plot_scaling.OURS: [(2, 0.2), (4, 0.7)],
                        _plot_scaling.TORCH: [(2, 0.3), (4, 0.6)],
                        _plot_scaling.FLOOR: floor, _plot_scaling.FLOOR_LOCAL: [(2, 0.03)]},
      'broadcast 64 MiB': {_plot_scaling.OURS: [(2, 21.0)], _plot_scaling.TORCH: [(2, 20.0)],
                           _plot_scaling.STREAM: [(2, 25.0), (4, 29.0)]},
  }
  assert list(series) == ['barrier', 'broadcast 8 B', 'broadcast 64 MiB']
  assert _plot_scaling.scaling_title(data).endswith(
      'commit abc1234, 2026-12-03, 2 cores, P=4 oversubscribed')
  # The committed data: the report of df085d5, 9 cases, 64 MiB not at P=8.
  committed = _plot_scaling.read_json(str(ROOT / 'docs' / 'scaling.json'))
  assert len(_plot_scaling.scaling_series(committed)) == 9
  assert 'commit df085d5' in _plot_scaling.scaling_title(committed)
  assert '2 cores, P=4 and 8 oversubscribed' in _plot_scaling.scaling_title(committed)



def test_the_kept_reports_are_data_the_picture_draws():
  """bench/data/report-*.json: every kept report has cases to draw and a title, a run with a core per process too."""
  reports = sorted((ROOT / 'bench' / 'data').glob('report-*.json'))
  assert len(reports) >= 20, reports
  for path in reports:
    data = _plot_scaling.read_json(str(path))
    assert _plot_scaling.scaling_series(data), path.name
    assert f'commit {data["commit"]}' in _plot_scaling.scaling_title(data)
  sixteen = _plot_scaling.read_json(
      str(ROOT / 'bench' / 'data' / 'report-14-16-cores.json'))
  assert _plot_scaling.scaling_title(sixteen).endswith(
      '16 cores, a core per process')

def test_the_report_writes_its_data_beside_it(tmp_path, monkeypatch):
  launches = []

  def bench_rows(processes, args, timeout, env=None):  # --versus, faked
    del timeout
    side = next((a.split('=', 1)[1] for a in args
                 if a.startswith('--versus_side=')), 'both')
    launches.append((processes, side))
    # The run with every link over TCP: twice the time, here.
    slower = 2 if env else 1
    ours = [0.1 * processes * slower, 0.3 * slower]
    torch = [0.5 * processes]
    # Each side alone: its n-th launch at this P takes n times as long.
    n = launches.count((processes, side))
    if side == 'ours':
      ours, torch = [0.1 * processes * n], None
    elif side == 'torch':
      ours, torch = [], [0.4 * processes * n]
    return [{'kind': 'versus', 'op': 'barrier', 'payload_bytes': 0,
             'processes': processes, 'ours_times_ms': ours,
             'torch_times_ms': torch}]
  monkeypatch.setattr(scaling, '_run', bench_rows)
  monkeypatch.setattr(scaling.os, 'cpu_count', lambda: 2)
  text = scaling.report(str(tmp_path / 'r.md'), rounds=3, soak_calls=0)
  data = _plot_scaling.read_json(str(tmp_path / 'r.json'))
  assert f'`{tmp_path / "r.json"}`' in text
  assert data['cores'] and data['command'].endswith('--report_soak=0')
  assert ('### P-scaling (ms per call; P=4 and P=8 run oversubscribed on 2 '
          'cores)') in text
  # At P > 2 each side alone too, in launches that alternate; a side's
  # median is over its launches.
  assert [s for p, s in launches if p == 2] == ['both', 'both']
  assert [s for p, s in launches if p == 4] == [
      'both', 'both', 'ours', 'torch', 'torch', 'ours']
  assert '| barrier (each side alone) | – | – | 0.60 | 2.40 | 1.20 | 4.80 |' in text
  assert _plot_scaling.scaling_series(data) == {'barrier': {
      _plot_scaling.OURS: [(2, 0.25), (4, 0.35), (8, 0.55)],
      _plot_scaling.TORCH: [(2, 1.0), (4, 2.0), (8, 4.0)],
      _plot_scaling.OURS_TCP: [(2, 0.5), (4, 0.7), (8, 1.1)],
      _plot_scaling.OURS_ALONE: [(4, 0.6), (8, 1.2)],
      _plot_scaling.TORCH_ALONE: [(4, 2.4), (8, 4.8)]}}
  # With a core per process, the title says so.
  monkeypatch.setattr(scaling.os, 'cpu_count', lambda: 16)
  text = scaling.report(str(tmp_path / 'r16.md'), rounds=3, soak_calls=0)
  assert ('### P-scaling (ms per call; a core per process at every P: 16 '
          'cores)') in text


def _drill() -> dict:
  rows = [{'P': p, 'first_call_ms': 100.0 * p, 'barrier_ms': 0.2 * p}
          for p in (2, 8, 4)]
  fits = [{'stage': 'first_call_ms', 'heading': 'first call ms',
           'model': 'O(P)'},
          {'stage': 'barrier_ms', 'heading': 'barrier ms',
           'model': 'O(log P)'}]
  return {'cores': 2, 'load_start': [0.5], 'load_end': [9.0], 'repeats': 3,
          'rows': rows, 'fits': fits}


def test_the_scale_drill_is_drawn_against_its_model_from_the_smallest_p():
  series = _plot_drill.drill_series(_drill())
  assert list(series) == ['first_call_ms', 'barrier_ms']
  first, barrier = series['first_call_ms'], series['barrier_ms']
  assert first['points'] == [(2, 200.0), (4, 400.0), (8, 800.0)]
  assert first['modelled'] == first['points']  # O(P): on the model.
  # O(log P) from P=2: 0.4 ms x log2(P) / log2(2).
  assert barrier['points'] == [(2, 0.4), (4, 0.8), (8, 1.6)]
  assert barrier['modelled'] == [(2, 0.4), (4, 0.8), (8, pytest.approx(1.2))]
  assert _plot_drill.drill_title(_drill()).startswith(
      'Scale drill: 2 cores, 3 repeats, load 0.5 at the start, 9.0 at the end')
  # The committed run: every stage of bench/scale_drill.py, P=2 to 48.
  committed = _plot_scaling.read_json(str(ROOT / 'docs' / 'scale_drill.json'))
  drawn = _plot_drill.drill_series(committed)
  assert len(drawn) == 7
  assert [p for p, _ in drawn['barrier_ms']['points']] == [2, 4, 8, 16, 32, 48]


def test_a_file_that_is_not_a_json_object_is_named(tmp_path):
  path = tmp_path / 'rows.json'
  path.write_text('[]')
  with pytest.raises(ValueError, match=r'rows.json holds a JSON list'):
    _plot_scaling.read_json(str(path))


def test_every_picture_is_written(tmp_path):
  pytest.importorskip('matplotlib', reason='bin/plot.py draws with '
                      'matplotlib, the optional extra "plot"')
  metrics = tmp_path / 'm.jsonl'
  _write(metrics, [{'step': s, 'loss': 2.0 ** -s} for s in range(1, 21)] +
         [{'event': 'save', 'step': 10}] +
         [{'step': s, 'loss': 2.0 ** -s} for s in range(11, 16)])
  bench = tmp_path / 'b.jsonl'
  _write(bench, [
      {'op': 'process_allgather', 'payload': f'{n} B', 'payload_bytes': n,
       'leaves': 1, 'kind': 'compare', 'ours_ms': 0.5 + n / 1e6,
       'jax_ms': 0.9 + n / 1e6, 'processes': 2} for n in (8, 1024, 2**20)])
  report = tmp_path / 'scaling.json'
  report.write_text(json.dumps(_scaling_report()))
  drill = tmp_path / 'drill.json'
  drill.write_text(json.dumps(_drill()))
  for flag, source in (('--metrics', metrics), ('--bench', bench),
                       ('--scaling', report), ('--scale_drill', drill)):
    out = tmp_path / f'{source.stem}.png'
    done = subprocess.run(
        [sys.executable, str(ROOT / 'bin' / 'plot.py'), f'{flag}={source}',
         f'--out={out}'], capture_output=True, text=True, timeout=120,
        check=False)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == _PNG
    assert out.stat().st_size > 10_000  # Axes, lines and text, not a blank.


def test_bad_flags_say_what_to_pass(tmp_path):
  done = subprocess.run(
      [sys.executable, str(ROOT / 'bin' / 'plot.py'), f'--out={tmp_path}/x'],
      capture_output=True, text=True, timeout=60, check=False)
  assert done.returncode != 0
  assert ('Pass exactly one of --metrics=FILE, --bench=FILE, '
          '--scaling=FILE or --scale_drill=FILE') in done.stderr


def _long_run(n: int = 2000, saves_every: int = 50) -> list[dict]:
  """A run like bin/train.py's: the loss falls to float noise with exact zeros among it, a save every 50 steps, a restart from the local tier."""
  records = []
  for s in range(1, n + 1):
    loss = max(0.5 * 0.8 ** s, 1e-15 * (1 + s % 7))
    records.append({'step': s, 'loss': 0.0 if s % 97 == 0 else loss})
    if s % saves_every == 0:
      records.append({'event': 'save', 'step': s})
    if s == 1234:
      records.append({'event': 'restart', 'step': 1230, 'tier': 'local'})
      records += [{'step': r, 'loss': 1e-15} for r in range(1231, 1235)]
  return records


def test_zeros_give_a_symlog_axis_from_the_data_and_positive_losses_a_log():
  losses = [0.5, 0.01, 3e-15, 0.0, 2e-15, 0.0] + [1e-15] * 200
  assert plot.loss_axis(losses) == ('symlog', 1e-15)
  assert plot.loss_axis([0.5, 0.01, 1e-9]) == ('log', None)
  assert plot.loss_axis([0.0, -1.0]) == ('linear', None)
  # A few spikes far above the rest are cut off; a falling curve is not.
  flat = [1e-3] * 500
  assert plot.clip_top(flat + [1e6, 1e7], 'log') == pytest.approx(1e-2)
  assert plot.clip_top([0.5 * 0.8 ** s for s in range(500)], 'log') is None
  assert plot.smoothing_window(400) == 0 and plot.smoothing_window(2000) == 21
  assert plot.rolling_median([1, 1, 100, 1, 1, 0, 1], 3) == [1, 1, 1, 1, 1, 1,
                                                              1]


def test_a_long_run_with_zeros_is_drawn_readable(tmp_path):
  pytest.importorskip('matplotlib', reason='bin/plot.py draws with '
                      'matplotlib, the optional extra "plot"')
  path = tmp_path / 'm.jsonl'
  _write(path, _long_run())
  run = plot.training_run(plot.read_jsonl(str(path)))
  out = tmp_path / 'long.png'
  drawn = plot.plot_training(run, str(out), 'long')
  assert out.read_bytes()[:8] == _PNG
  # Zeros among the losses: a symlog axis, linear below their decade.
  assert drawn.yscale == 'symlog' and drawn.linthresh == 1e-15, drawn
  # 40 saves: one row of ticks, not 40 lines; the restart is a line with
  # its tier.
  assert drawn.ticks == {'save': 40}, drawn
  assert drawn.lines == ['restart (local tier)'], drawn
  # The longer attempt (steps 1-1234) sets the window: 1234 // 100, odd.
  assert drawn.window == 13, drawn
