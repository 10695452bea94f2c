"""bin/plot.py: what a training run and a benchmark run are drawn from, and the PNGs."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / 'bin'))
import plot  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

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


def test_both_pictures_are_written(tmp_path):
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
  for flag, source in (('--metrics', metrics), ('--bench', bench)):
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
  assert 'Pass exactly one of --metrics=FILE or --bench=FILE' in done.stderr


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
