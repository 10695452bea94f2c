r"""Draws a training run or a benchmark run as a PNG (needs matplotlib).

A training run (`bin/train.py --metrics_out=FILE`): loss per step, with the
checkpoints (ticks along the bottom), restarts and resumes (lines, labelled
with the tier they resumed from) marked. The loss axis is logarithmic; with
zeros among the losses it is symmetric-logarithmic, linear below the decade
of the smallest losses; a few spikes far above the rest are cut off and
marked; a stretch of more than 400 steps is drawn faint, under its rolling
median.

  python bin/plot.py --metrics=/tmp/m.jsonl --out=/tmp/train.png

A benchmark run (`bin/bench.py --json=FILE`): median time per call by payload
size, one line per implementation (ours, JAX's, torch.distributed gloo, a raw
loopback TCP stream), one panel per operation.

  python bin/plot.py --bench=/tmp/bench.jsonl --out=/tmp/bench.png

A P-scaling report (`bin/bench.py --report=FILE.md` writes FILE.json beside
it): median time per call against the process count P, ours and torch
gloo's, one panel per case, with one round trip (the floor) on the panels of
calls up to 1 MiB and the raw TCP stream on the broadcast of its size.

  python bin/plot.py --scaling=/tmp/report.json --out=/tmp/scaling.png

The scale drill (`bench/scale_drill.py --out=FILE`): the first call, the
links' setup and the repeated calls against P, each beside the docs' model
(dashed).

  python bin/plot.py --scale_drill=/tmp/drill.json --out=/tmp/drill.png

Write the pictures somewhere new (as these examples do): docs/train.png,
docs/bench_p2.png, docs/scaling.png and docs/scale_drill.png are
committed, made from docs/train_metrics.jsonl, docs/bench_p2.jsonl,
docs/scaling.json and docs/scale_drill.json.

matplotlib is an optional extra (`pip install -e ".[plot]"`); nothing else in
the project imports it.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import sys

import _figures  # bin/_figures.py: the figure helpers every picture uses.
import _plot_drill as drill  # bin/_plot_drill.py: the scale drill's picture.
import _plot_scaling as scaling  # bin/_plot_scaling.py: the P-scaling picture.
from absl import app
from absl import flags

_METRICS = flags.DEFINE_string(
    'metrics', '', 'A JSON Lines file written by bin/train.py --metrics_out.')
_BENCH = flags.DEFINE_string(
    'bench', '', 'A JSON Lines file written by bin/bench.py --json.')
_SCALING = flags.DEFINE_string(
    'scaling', '', 'A JSON file written by bin/bench.py --report (the report '
    'with .json for .md).')
_DRILL = flags.DEFINE_string(
    'scale_drill', '', 'A JSON file written by bench/scale_drill.py --out.')
_OUT = flags.DEFINE_string('out', '', 'The PNG to write.')
_TITLE = flags.DEFINE_string(
    'title', '', 'A title; default: the file name (--scaling: the run\'s '
    'commit, date and cores).')


def read_jsonl(path: str) -> list[dict]:
  """The objects of a JSON Lines file; a torn last line (a killed writer) is dropped."""
  records = []
  with open(path) as f:
    lines = f.read().splitlines()
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError as e:
      if number == len(lines):
        break  # A run killed mid-write leaves a partial last line.
      raise ValueError(f'{path}:{number} is not JSON ({e}); pass a file '
                       'written by bin/train.py or bin/bench.py.') from e
  return records


Run = collections.namedtuple('Run', 'steps losses events')
Run.__doc__ = """Loss points in file order; events as (kind, step, tier or None)."""


def training_run(records: list[dict]) -> Run:
  """Loss points in file order, and the events (save, resume, restart) to mark.

  A step that is not after the previous one starts a new attempt: a resume
  (from a checkpoint, by a relaunch or a restart) replays from there. Records
  with an 'event' key (as `bin/train.py` writes them) are marks as they are.
  """
  steps, losses, events = [], [], []
  last = None
  for r in records:
    if 'event' in r:
      events.append((r['event'], int(r.get('step', last or 0)),
                     r.get('tier')))
      continue
    if 'step' not in r or r.get('loss') is None:
      continue
    step = int(r['step'])
    if last is not None and step <= last and not any(
        e[0] in ('resume', 'restart') and e[1] == step - 1 for e in events):
      events.append(('resume', step - 1, None))
    steps.append(step)
    losses.append(float(r['loss']))
    last = step
  return Run(steps, losses, events)


# Marks across the axes: (colour, line style).
_MARKS = {'resume': ('tab:orange', '--'), 'restart': ('tab:red', '-'),
          'preempted': ('tab:purple', '-.'), 'set_aside': ('tab:brown', ':')}
# Events drawn as ticks along the bottom (one artist for all of a kind).
_TICKS = {'save': 'tab:green'}
# A stretch (an attempt) longer than this many steps is drawn smoothed.
SMOOTH_ABOVE = 400

Drawn = collections.namedtuple('Drawn', 'yscale linthresh top ticks lines '
                               'window')
Drawn.__doc__ = """What `plot_training` drew: the loss axis's scale (and
symlog's linear threshold, the axis's top when spikes were clipped), per
tick kind how many ticks, the vertical lines' labels, the smoothing window
(steps; 0: none)."""


def loss_axis(losses: list[float]) -> tuple[str, float | None]:
  """The loss axis that keeps zeros and spikes readable: ('log', None) when every loss is positive, else ('symlog', linthresh) with linthresh the decade at or below the 1st percentile of the positive losses (zeros sit on a linear stretch below it), or ('linear', None) when none is positive."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  values = np.asarray(losses, dtype=float)
  values = values[np.isfinite(values)]
  positive = values[values > 0]
  if values.size and positive.size == values.size:
    return 'log', None
  if not positive.size:
    return 'linear', None
  low = float(np.percentile(positive, 1))
  return 'symlog', float(10.0 ** np.floor(np.log10(low)))


def clip_top(losses: list[float], scale: str) -> float | None:
  """Where to cut the loss axis so that a few spikes do not flatten the rest: None (no cut) unless the largest loss is over 100x (log scales; linear: over 10 spreads above) the 99.5th percentile; then 10x that percentile (linear: 3 spreads above it)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  values = np.asarray(losses, dtype=float)
  values = values[np.isfinite(values)]
  if values.size < 20:
    return None
  high = float(np.percentile(values, 99.5))
  if scale == 'linear':
    spread = high - float(np.percentile(values, 50))
    if spread > 0 and values.max() > high + 10 * spread:
      return high + 3 * spread
    return None
  if high > 0 and values.max() > 100 * high:
    return 10 * high
  return None


def smoothing_window(n: int) -> int:
  """Steps of the rolling median for a stretch of `n` points: 0 (raw) up to `SMOOTH_ABOVE` points, else about n/100, odd, at least 5."""
  if n <= SMOOTH_ABOVE:
    return 0
  return max(5, (n // 100) | 1)


def rolling_median(values: list[float], window: int) -> list[float]:
  """The median of each point's `window` neighbours (fewer at the ends); robust to zeros and spikes."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  half = window // 2
  padded = np.pad(np.asarray(values, dtype=float), half, mode='edge')
  windows = np.lib.stride_tricks.sliding_window_view(padded, window)
  return np.median(windows, axis=1).tolist()


def _event_label(kind: str, record_tier: str | None) -> str:
  return f'{kind} ({record_tier} tier)' if record_tier else kind


def plot_training(run: Run, out: str, title: str) -> Drawn:
  """Writes the loss curve (smoothed when long) on an axis that shows zeros and spikes, saves as ticks, restarts, resumes and their tiers as labelled lines; returns what it drew."""
  plt = _figures.pyplot()
  fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
  scale, linthresh = loss_axis(run.losses)
  # Each attempt is its own line, so a replayed stretch shows as an overlap.
  start, window, first = 0, 0, True
  for i in range(1, len(run.steps) + 1):
    if i == len(run.steps) or run.steps[i] <= run.steps[i - 1]:
      xs, ys = run.steps[start:i], run.losses[start:i]
      w = smoothing_window(len(xs))
      if w:
        window = max(window, w)
        ax.plot(xs, ys, color='tab:blue', linewidth=0.5, alpha=0.25,
                label='loss, every step' if first else None)
        ax.plot(xs, rolling_median(ys, w), color='tab:blue', linewidth=1.4,
                label=f'loss, median of {w} steps' if first else None)
      else:
        ax.plot(xs, ys, color='tab:blue', linewidth=1.2,
                label='loss' if first else None)
      first = False
      start = i
  if scale == 'symlog':
    ax.set_yscale('symlog', linthresh=linthresh)
  else:
    ax.set_yscale(scale)
  top = clip_top(run.losses, scale)
  if top is not None:
    cut = [(s, v) for s, v in zip(run.steps, run.losses) if v > top]
    ax.set_ylim(top=top)
    ax.plot([s for s, _ in cut], [top] * len(cut), '^', color='tab:blue',
            markersize=5, clip_on=False,
            label=f'{len(cut)} loss(es) above the axis')
  ticks = {}
  for kind, color in _TICKS.items():
    steps = [step for k, step, _ in run.events if k == kind]
    if steps:
      ticks[kind] = len(steps)
      ax.plot(steps, [0.0] * len(steps), linestyle='none', marker='|',
              markersize=9, markeredgewidth=1, color=color, clip_on=False,
              transform=ax.get_xaxis_transform(),
              label=f'{kind} ({len(steps)})')
  lines, seen = [], set()
  for kind, step, tier in run.events:
    if kind in _TICKS:
      continue
    label = _event_label(kind, tier)
    color, style = _MARKS.get(kind, ('grey', ':'))
    ax.axvline(step, color=color, linestyle=style, linewidth=1,
               label=None if label in seen else label)
    ax.annotate(label, (step, 1.0), xycoords=('data', 'axes fraction'),
                xytext=(2, -2), textcoords='offset points', fontsize=7,
                color=color, va='top', rotation=90)
    seen.add(label)
    lines.append(label)
  ax.set_xlabel('step')
  ax.set_ylabel('loss' + (f' (symlog: linear below {linthresh:g})'
                          if scale == 'symlog' else ''))
  ax.set_title(title)
  ax.legend(loc='upper right', fontsize=8)
  ax.grid(alpha=0.3)
  _figures.save(plt, fig, out)
  return Drawn(yscale=scale, linthresh=linthresh, top=top, ticks=ticks,
               lines=lines, window=window)


def _family(op: str) -> str | None:
  """The panel a benchmark row belongs to, or None for rows not drawn."""
  op = op.lower()
  if 'barrier' in op or op.startswith('sync_global_devices'):
    return 'barrier'
  if 'broadcast_object' in op or 'broadcast_object_list' in op:
    return 'broadcast an object'
  if 'allgather_object' in op or 'all_gather_object' in op:
    return 'all-gather an object'
  if 'loopback tcp' in op:
    return 'broadcast'  # A raw stream: the bound for a one-to-one transfer.
  if 'broadcast' in op:
    return 'broadcast'
  if 'allgather' in op or 'all_gather' in op or 'all-gather' in op:
    return 'all-gather'
  return None


def _label(row: dict, side: str) -> str:
  op = row['op'].lower()
  if side == 'jax':
    return 'jax.experimental.multihost_utils'
  if 'torch' in op:
    return 'torch.distributed gloo'
  if 'loopback tcp' in op:
    return 'raw TCP stream'
  if 'coordination service' in op:
    return 'coordination-service barrier'
  if 'plain jitted' in op:
    return 'plain jitted (global array)'
  return 'multihost'


def bench_series(rows: list[dict]) -> dict[str, dict[str, list]]:
  """{panel: {implementation: [(payload bytes, ms), ...]}} for single-leaf rows."""
  panels: dict[str, dict[str, list]] = collections.defaultdict(
      lambda: collections.defaultdict(list))
  for r in rows:
    family = _family(r.get('op', ''))
    if family is None or r.get('leaves', 1) > 1:
      continue
    payload = r.get('payload', '')
    if (any(w in r['op'] for w in ('mismatch', 'is_source', 'tiled')) or
        any(w in payload for w in ('late', 'global', 'leaves'))):
      continue  # Special cases: the tables show them.
    size = max(int(r.get('payload_bytes') or 0), 1)
    if r.get('kind') == 'reference':
      if r.get('ref_ms') is not None:
        panels[family][_label(r, 'ref')].append((size, r['ref_ms']))
      continue
    if r.get('kind', 'compare') != 'compare':
      continue
    for side, key in (('ours', 'ours_ms'), ('jax', 'jax_ms')):
      if r.get(key) is not None:
        panels[family][_label(r, side)].append((size, r[key]))
  return {f: {k: sorted(v) for k, v in s.items()} for f, s in panels.items()}


def plot_bench(series: dict[str, dict[str, list]], out: str, title: str,
               processes: int | None) -> None:
  """Writes one log-log panel per operation."""
  plt = _figures.pyplot()
  order = [f for f in ('barrier', 'broadcast', 'all-gather',
                       'broadcast an object', 'all-gather an object')
           if f in series]
  fig, axes = _figures.panels(plt, len(order), 5, 3.8)
  names = sorted({n for s in series.values() for n in s})
  colors = {n: f'C{i}' for i, n in enumerate(names)}
  for ax, family in zip(axes, order, strict=True):
    if family == 'barrier':  # No payload: one bar per implementation.
      items = sorted(series[family].items())
      ax.barh([n for n, _ in items], [p[0][1] for _, p in items],
              color=[colors[n] for n, _ in items])
      ax.set_xlabel('median ms per call')
      ax.set_title(family)
      ax.grid(alpha=0.3, axis='x')
      continue
    for name, points in sorted(series[family].items()):
      xs = [p[0] for p in points]
      ys = [p[1] for p in points]
      style = '-o' if len(points) > 1 else 'o'
      ax.plot(xs, ys, style, markersize=4, label=name, color=colors[name])
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.set_title(family)
    ax.set_xlabel('payload bytes')
    ax.set_ylabel('median ms per call')
    ax.grid(alpha=0.3, which='both')
    ax.legend(fontsize=7)
  suffix = f' (P={processes})' if processes else ''
  fig.suptitle(title + suffix)
  _figures.save(plt, fig, out)


def main(argv):
  del argv  # Unused.
  given = [f for f in (_METRICS, _BENCH, _SCALING, _DRILL) if f.value]
  if len(given) != 1:
    raise app.UsageError('Pass exactly one of --metrics=FILE, --bench=FILE, '
                         '--scaling=FILE or --scale_drill=FILE.')
  if not _OUT.value:
    raise app.UsageError('Pass --out=PNG, the picture to write.')
  if importlib.util.find_spec('matplotlib') is None:
    sys.exit('bin/plot.py needs matplotlib, an optional extra: '
             'pip install -e ".[plot]"')
  path = given[0].value
  try:
    if _SCALING.value:
      data = scaling.read_json(path)
    elif _DRILL.value:
      data = scaling.read_json(
          path, 'the file bench/scale_drill.py --out writes')
    else:
      records = read_jsonl(path)
  except OSError as e:
    raise app.UsageError(f'cannot read {path}: {e}') from e
  title = _TITLE.value or path
  if _DRILL.value:
    series = drill.drill_series(data)
    if not series:
      raise app.UsageError(f'{path} holds no fitted stages to draw; pass '
                           'the file bench/scale_drill.py --out writes.')
    drill.plot_drill(series, _OUT.value, _TITLE.value or drill.drill_title(data))
  elif _SCALING.value:
    series = scaling.scaling_series(data)
    if not series:
      raise app.UsageError(f'{path} holds no compared cases to draw; pass '
                           'the .json file bin/bench.py --report writes.')
    scaling.plot_scaling(series, _OUT.value,
                         _TITLE.value or scaling.scaling_title(data))
  elif _METRICS.value:
    run = training_run(records)
    if not run.steps:
      raise app.UsageError(f'{path} holds no loss records; pass a file '
                           'written by bin/train.py --metrics_out.')
    plot_training(run, _OUT.value, title)
  else:
    series = bench_series(records)
    if not series:
      raise app.UsageError(f'{path} holds no benchmark rows to draw; pass a '
                           'file written by bin/bench.py --json.')
    processes = next((r.get('processes') for r in records
                      if r.get('processes')), None)
    plot_bench(series, _OUT.value, title, processes)
  print(f'Wrote {_OUT.value}')


if __name__ == '__main__':
  app.run(main)
