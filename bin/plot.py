r"""Draws a training run or a benchmark run as a PNG (needs matplotlib).

A training run (`bin/train.py --metrics_out=FILE`): loss per step, with the
checkpoints, restarts and resumes marked.

  python bin/plot.py --metrics=/tmp/m.jsonl --out=/tmp/train.png

A benchmark run (`bin/bench.py --json=FILE`): median time per call by payload
size, one line per implementation (ours, JAX's, torch.distributed gloo, a raw
loopback TCP stream), one panel per operation.

  python bin/plot.py --bench=/tmp/bench.jsonl --out=/tmp/bench.png

matplotlib is an optional extra (`pip install -e ".[plot]"`); nothing else in
the project imports it.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import sys

from absl import app
from absl import flags

_METRICS = flags.DEFINE_string(
    'metrics', '', 'A JSON Lines file written by bin/train.py --metrics_out.')
_BENCH = flags.DEFINE_string(
    'bench', '', 'A JSON Lines file written by bin/bench.py --json.')
_OUT = flags.DEFINE_string('out', '', 'The PNG to write.')
_TITLE = flags.DEFINE_string('title', '', 'A title; default: the file name.')


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
      events.append((r['event'], int(r.get('step', last or 0))))
      continue
    if 'step' not in r or r.get('loss') is None:
      continue
    step = int(r['step'])
    if last is not None and step <= last and not any(
        e[0] in ('resume', 'restart') and e[1] == step - 1 for e in events):
      events.append(('resume', step - 1))
    steps.append(step)
    losses.append(float(r['loss']))
    last = step
  return Run(steps, losses, events)


_MARKS = {'save': ('tab:green', ':'), 'resume': ('tab:orange', '--'),
          'restart': ('tab:red', '-'), 'preempted': ('tab:purple', '-.')}


def plot_training(run: Run, out: str, title: str) -> None:
  """Writes the loss curve with the run's events as vertical lines."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
  # Each attempt is its own line, so a replayed stretch shows as an overlap.
  start = 0
  for i in range(1, len(run.steps) + 1):
    if i == len(run.steps) or run.steps[i] <= run.steps[i - 1]:
      ax.plot(run.steps[start:i], run.losses[start:i], color='tab:blue',
              linewidth=1.2, label='loss' if start == 0 else None)
      start = i
  seen = set()
  for kind, step in run.events:
    color, style = _MARKS.get(kind, ('grey', ':'))
    ax.axvline(step, color=color, linestyle=style, linewidth=1,
               label=None if kind in seen else kind)
    seen.add(kind)
  ax.set_yscale('log' if run.losses and min(run.losses) > 0 else 'linear')
  ax.set_xlabel('step')
  ax.set_ylabel('loss')
  ax.set_title(title)
  ax.legend(loc='upper right')
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out)
  plt.close(fig)


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
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  order = [f for f in ('barrier', 'broadcast', 'all-gather',
                       'broadcast an object', 'all-gather an object')
           if f in series]
  cols = min(3, len(order))
  rows = -(-len(order) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows),
                           dpi=100, squeeze=False)
  for ax in axes.flat[len(order):]:
    ax.set_visible(False)
  names = sorted({n for s in series.values() for n in s})
  colors = {n: f'C{i}' for i, n in enumerate(names)}
  for ax, family in zip(axes.flat, order):
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
  fig.tight_layout()
  fig.savefig(out)
  plt.close(fig)


def main(argv):
  del argv  # Unused.
  if bool(_METRICS.value) == bool(_BENCH.value):
    raise app.UsageError('Pass exactly one of --metrics=FILE or --bench=FILE.')
  if not _OUT.value:
    raise app.UsageError('Pass --out=PNG, the picture to write.')
  if importlib.util.find_spec('matplotlib') is None:
    sys.exit('bin/plot.py needs matplotlib, an optional extra: '
             'pip install -e ".[plot]"')
  path = _METRICS.value or _BENCH.value
  try:
    records = read_jsonl(path)
  except OSError as e:
    raise app.UsageError(f'cannot read {path}: {e}') from e
  title = _TITLE.value or path
  if _METRICS.value:
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
