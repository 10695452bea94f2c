"""bin/plot.py --scale_drill: the scale drill's picture, from the JSON `bench/scale_drill.py --out` writes.

Two panels against the process count P, both axes logarithmic: the start
(the first call, and the links ready) and the repeated calls (barrier,
8-byte all-gather and broadcast, 1 MiB broadcast), each measurement with
the docs' model beside it as a dashed line (O(log P) or O(P), scaled from
the smallest P, as the drill's table sets them), so the point where a
curve leaves its model shows.
"""

from __future__ import annotations

import math

import _figures  # bin/_figures.py: the figure helpers every picture uses.

START = ('first_call_ms', 'links_ready_ms')
CALLS = ('barrier_ms', 'allgather_8b_ms', 'broadcast_8b_ms',
         'broadcast_1mib_ms')


def drill_series(data: dict) -> dict[str, dict]:
  """{stage: {'heading', 'model', 'points': [(P, ms)], 'modelled': [(P, ms)]}} for every stage the drill fitted, in its order.

  `modelled` is the docs' model through the smallest P's measurement:
  t(P0) f(P) / f(P0), f = log2 for O(log P), the identity for O(P).
  """
  rows = sorted(data.get('rows', []), key=lambda r: r['P'])
  out = {}
  for fit in data.get('fits', []):
    key = fit['stage']
    points = [(r['P'], r[key]) for r in rows if r.get(key) is not None]
    if not points:
      continue
    f = math.log2 if fit['model'] == 'O(log P)' else float
    p0, t0 = points[0]
    out[key] = {'heading': fit['heading'], 'model': fit['model'],
                'points': points,
                'modelled': [(p, t0 * f(p) / f(p0)) for p, _ in points]}
  return out


def drill_title(data: dict) -> str:
  """The run in one line: cores, repeats and the load at its start and end."""
  cores = data.get('cores', '?')
  start, end = (_load(data.get(k)) for k in ('load_start', 'load_end'))
  return (f'Scale drill: {cores} cores, {data.get("repeats", "?")} repeats, '
          f'load {start} at the start, {end} at the end (oversubscribed '
          f'above P={cores})')


def _load(averages: list | None) -> str:
  """The 1-minute load average of os.getloadavg()'s list, or '?'."""
  first = (averages or ['?'])[0]
  return f'{first:.1f}' if isinstance(first, (int, float)) else str(first)


def plot_drill(series: dict[str, dict], out: str, title: str) -> None:
  """Writes the two panels (start, repeated calls), measurements solid, models dashed."""
  plt = _figures.pyplot()
  fig, axes = _figures.panels(plt, 2, 6.5, 4.6)
  for ax, keys, name in ((axes[0], START, 'start'),
                         (axes[1], CALLS, 'repeated calls (median)')):
    for i, key in enumerate(k for k in keys if k in series):
      s = series[key]
      color = f'C{i}'
      ax.plot(*zip(*s['points'], strict=True), '-o', markersize=4,
              color=color, label=s['heading'])
      ax.plot(*zip(*s['modelled'], strict=True), '--', color=color,
              alpha=0.6, label=f'{s["model"]} model')
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.set_xlabel('processes P')
    ax.set_ylabel('ms')
    ax.set_title(name)
    ax.grid(alpha=0.3, which='both')
    ax.legend(fontsize=7)
  fig.suptitle(title, fontsize=10)
  _figures.save(plt, fig, out)
