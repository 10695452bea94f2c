"""bin/plot.py --scaling: the P-scaling picture, from the data `bin/bench.py --report` writes beside its report (`bench/scaling.py`).

One panel per case: ours (and ours with every link over TCP) and torch
gloo's median ms per call against the process count P, with the round
trips as the floor of the small calls and the raw TCP stream beside the
broadcast of its size.
"""

from __future__ import annotations

import collections
import json

import _figures  # bin/_figures.py: the figure helpers every picture uses.

# A P-scaling report's series. Its reference rows (ours alone: torch_ms is
# None) are known by the start of their case name.
OURS, TORCH = 'multihost', 'torch.distributed gloo'
# Ours again with every link over TCP (bench/versus.py's OVER_TCP rows).
OVER_TCP, OURS_TCP = ' (links over TCP)', 'multihost, links over TCP'
ROUND_TRIP, FLOOR = 'round trip', 'one TCP round trip (the floor)'
LOCAL, FLOOR_LOCAL = 'local socket', 'one local-socket round trip'
RAW_STREAM, STREAM = 'raw TCP stream', 'raw TCP stream, process 0 -> 1'
# Each side alone in launches of its own (bench/versus.py's ALONE rows).
ALONE = ' (each side alone)'
OURS_ALONE, TORCH_ALONE = 'multihost alone', 'torch gloo alone'
# The round trip is drawn on the panels of calls up to this many bytes (a
# latency floor; a 64 MiB call is bound by bandwidth instead).
FLOOR_UP_TO = 1 << 20


def read_json(path: str,
              what: str = 'the .json file bin/bench.py --report writes'
              ) -> dict:
  """The object a JSON file holds; a file that is not one is a ValueError that names it and says to pass `what`."""
  with open(path) as f:
    try:
      value = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f'{path} is not JSON ({e}); pass {what}.') from e
  if not isinstance(value, dict):
    raise ValueError(f'{path} holds a JSON {type(value).__name__}, not an '
                     f'object; pass {what}.')
  return value


def scaling_series(data: dict) -> dict[str, dict[str, list]]:
  """{case: {series: [(P, median ms), ...]}}, cases in the report's order, from what `bench/scaling.py` writes.

  Each compared case gets ours and torch gloo's medians, ours with every
  link over TCP and each side alone (its own launches) where the report
  has them; the CPU-busy rows (P=2 alone) are left out. The round trips
  (TCP, local socket) are added, as the floor, to every case of up to
  `FLOOR_UP_TO` bytes, and the raw TCP stream to the broadcast of its
  size. A case missing at some P (64 MiB at P=8) has no point there.
  """
  cases: dict[str, dict[str, list]] = {}
  sizes: dict[str, int] = {}
  floor, local_floor, streams = [], [], collections.defaultdict(list)
  tcp = collections.defaultdict(list)
  alone = collections.defaultdict(lambda: {OURS_ALONE: [], TORCH_ALONE: []})
  for r in data.get('rows', []):
    if r.get('busy') or r.get('ours_ms') is None:
      continue
    p, op, ms = int(r['processes']), r['op'], r['ours_ms']
    size = int(r.get('payload_bytes') or 0)
    if r.get('torch_ms') is not None and op.endswith(ALONE):
      base = alone[op[:-len(ALONE)]]
      base[OURS_ALONE].append((p, ms))
      base[TORCH_ALONE].append((p, r['torch_ms']))
    elif r.get('torch_ms') is not None and op.endswith(OVER_TCP):
      base = op[:-len(OVER_TCP)]
      tcp[base].append((p, ms))
    elif r.get('torch_ms') is not None:
      series = cases.setdefault(op, {OURS: [], TORCH: []})
      series[OURS].append((p, ms))
      series[TORCH].append((p, r['torch_ms']))
      sizes[op] = size
    elif op.startswith(ROUND_TRIP):
      (local_floor if LOCAL in op else floor).append((p, ms))
    elif op.startswith(RAW_STREAM):
      streams[size].append((p, ms))
  for op, series in cases.items():
    if tcp.get(op):
      series[OURS_TCP] = tcp[op]
    if op in alone:
      series.update(alone[op])
    if floor and sizes[op] <= FLOOR_UP_TO:
      series[FLOOR] = floor
    if local_floor and sizes[op] <= FLOOR_UP_TO:
      series[FLOOR_LOCAL] = local_floor
    if streams.get(sizes[op]) and op.startswith('broadcast '):
      series[STREAM] = streams[sizes[op]]
  return {op: {k: sorted(v) for k, v in s.items()} for op, s in cases.items()}


def scaling_title(data: dict) -> str:
  """The run a P-scaling picture shows: its commit, date, cores, and which P were oversubscribed."""
  cores = data.get('cores')
  ps = sorted({int(r['processes']) for r in data.get('rows', [])})
  over = [str(p) for p in ps if cores and p > cores]
  parts = [f'commit {data.get("commit", "unknown")}']
  if data.get('date'):
    parts.append(data['date'])
  if cores and over:
    listed = (over[0] if len(over) == 1 else
              f'{", ".join(over[:-1])} and {over[-1]}')
    parts.append(f'{cores} cores, P={listed} oversubscribed')
  elif cores:
    parts.append(f'{cores} cores, a core per process')
  return ('median ms per call against the process count P: '
          + ', '.join(parts))


# Each series' look on every panel: (colour, line and marker style).
_SCALING_STYLE = {OURS: ('C0', '-o'), OURS_TCP: ('C0', '--x'),
                  TORCH: ('C1', '-s'), FLOOR: ('grey', '--'),
                  FLOOR_LOCAL: ('grey', ':'), STREAM: ('C2', ':^'),
                  OURS_ALONE: ('C0', ':D'), TORCH_ALONE: ('C1', ':v')}


def _plain_log_labels(ticker, *, minor: bool):
  """A log axis's labels as plain numbers (0.1, 30, 600), on the ticks matplotlib's `LogFormatter` labels: the minor ones where a panel spans about a decade or less."""

  class Plain(ticker.LogFormatter):

    def __call__(self, x, pos=None):
      return f'{x:g}' if super().__call__(x, pos) else ''

  return Plain(labelOnlyBase=not minor)


def plot_scaling(series: dict[str, dict[str, list]], out: str,
                 title: str) -> None:
  """Writes one panel per case: ms per call against P, both axes logarithmic, P's ticks at the measured counts, one legend for all."""
  plt = _figures.pyplot()
  from matplotlib import ticker  # pylint: disable=import-outside-toplevel
  fig, axes = _figures.panels(plt, len(series), 4.2, 3.2)
  ps = sorted({p for s in series.values() for pts in s.values()
               for p, _ in pts})
  for ax, (case, lines) in zip(axes, series.items(), strict=True):
    for name, points in lines.items():
      color, style = _SCALING_STYLE.get(name, ('black', '-'))
      ax.plot([p for p, _ in points], [ms for _, ms in points], style,
              color=color, markersize=4, label=name)
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.set_xticks(ps, [str(p) for p in ps])
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.yaxis.set_major_formatter(_plain_log_labels(ticker, minor=False))
    ax.yaxis.set_minor_formatter(_plain_log_labels(ticker, minor=True))
    ax.set_xlim(ps[0] / 1.3, ps[-1] * 1.3)
    ax.set_title(case, fontsize=10)
    ax.set_xlabel('processes P', fontsize=8)
    ax.set_ylabel('median ms per call', fontsize=8)
    ax.tick_params(which='both', labelsize=8)
    ax.grid(alpha=0.3)
    ax.grid(alpha=0.1, which='minor')
  handles = {}
  for ax in axes:
    for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
      handles.setdefault(label, handle)
  # At most three entries a row, so that the legend fits the figure's width.
  rows = -(-len(handles) // 3)
  fig.legend(handles.values(), handles.keys(), loc='lower center',
             ncol=min(len(handles), 3), fontsize=9, frameon=False)
  fig.suptitle(title, fontsize=11)
  _figures.save(plt, fig, out, rect=(0, 0.025 * rows + 0.01, 1, 1))
