"""Large P on one machine: the control and data planes' costs against the number of processes.

A standalone script (run from the repository root; it starts the launcher
itself, once per P). For each P in --processes it launches P controllers
with 1 CPU device each (`JAX_PLATFORMS=cpu`); each runs this file with
--worker: `multihost.initialize()`, then, timed with `time.perf_counter` on
every process (host numpy arrays only, nothing compiled):

  first call   the first collective (an 8-byte `process_allgather` of when
               the process finished initializing): it meets through the
               coordination service
  links ready  from the start of the first call until
               `links.usable(runtime.current())` is True, looping
               `sync_global_devices` as tests/programs/eager_gave_up.py does
               (the TCP links are set up on a thread after the first
               meeting; every process switches in the same call);
               `links after first call`: that minus the first call,
               the slowest process's
  then --repeats rounds (after 2 untimed ones) of: a barrier
  (`sync_global_devices`), an 8-byte `process_allgather`, an 8-byte and a
  1 MiB `broadcast_one_to_all`.

Every process's times are all-gathered at the end; process 0 prints one
JSON line. Per call the slowest process counts; the table gives medians of
that over the rounds. `init s` is the wall time from the launch until the
last process returned from `multihost.initialize()`.

  python bench/scale_drill.py --processes=2,4,8,16,32 --repeats=30 \\
      --out=/tmp/scale.json

Then each column is fitted against log2(P), P and P log2(P) (least squares
of t = a + b f(P); the better of the first two by residual is named), and
set against the model the docs state (O(log P) for the barrier, the small
calls, which agree over the links in ceil(log2 P) rounds (from 3 to 8
processes on one host: a star at process 0, two hops), the links' setup,
up to 2 ceil(log2 P) peers per process, and the 1 MiB broadcast, a
binomial tree of ceil(log2 P) hops; O(P) for the first call, which meets
at process 0's service, and so for `links ready`, which contains it),
scaled from the smallest P: t(P0) f(P) / f(P0). The first P where the measurement exceeds
that by more than --leave_factor is named. On a machine with fewer cores
than P every process shares the cores, so the runs are oversubscribed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from multihost import env as _env  # noqa: E402  (after the path is set)

# Column key, table heading, the docs' model ('log' or 'linear').
STAGES = (
    ('first_call_ms', 'first call ms', 'linear'),
    ('links_ready_ms', 'links ready ms', 'linear'),
    ('links_setup_ms', 'links after first call ms', 'log'),
    ('allgather_8b_ms', 'allgather 8 B ms', 'log'),
    ('barrier_ms', 'barrier ms', 'log'),
    ('broadcast_8b_ms', 'broadcast 8 B ms', 'log'),
    ('broadcast_1mib_ms', 'broadcast 1 MiB ms', 'log'),
)
REPEATED = ('barrier_ms', 'allgather_8b_ms', 'broadcast_8b_ms',
            'broadcast_1mib_ms')
WARMUP = 2
LAUNCH_T0 = _env.SCALE_DRILL_LAUNCH_T0


# --------------------------------------------------------------- the worker


def worker(repeats: int) -> None:
  """One controller: initialize, time the stages, all-gather the times; process 0 prints one JSON line."""
  sys.path.insert(0, str(ROOT))
  import numpy as np  # noqa: PLC0415

  import multihost  # noqa: PLC0415
  from multihost._src.control import links  # noqa: PLC0415
  from multihost._src.runtime import runtime  # noqa: PLC0415

  multihost.initialize()
  # Seconds since the launch (float32 once gathered: JAX's x64 is off).
  initialized = time.time() - float(os.environ.get(LAUNCH_T0, 'nan'))
  import jax  # noqa: PLC0415  (after initialize)
  me, count = jax.process_index(), jax.process_count()
  clock = time.perf_counter

  t0 = clock()
  stamps = multihost.process_allgather(np.float32(initialized))
  first = clock() - t0
  syncs = 0
  deadline = clock() + links.SETUP_S
  while not links.usable(runtime.current()) and clock() < deadline:
    multihost.sync_global_devices('scale drill: links')
    syncs += 1
    if links.usable(runtime.current()):
      break
    time.sleep(0.005)
  ready = clock() - t0
  usable = links.usable(runtime.current())

  small = np.arange(2, dtype=np.float32) + me  # 8 bytes
  big = np.arange(1 << 18, dtype=np.float32) + me  # 1 MiB
  ops = {
      'barrier_ms': lambda: multihost.sync_global_devices('scale drill'),
      'allgather_8b_ms': lambda: multihost.process_allgather(small),
      'broadcast_8b_ms': lambda: multihost.broadcast_one_to_all(small),
      'broadcast_1mib_ms': lambda: multihost.broadcast_one_to_all(big),
  }
  times = np.zeros((repeats, len(REPEATED)))
  cpu0 = 0.0
  for r in range(-WARMUP, repeats):
    if r == 0:
      cpu0 = time.process_time()
    for j, key in enumerate(REPEATED):
      s = clock()
      out = ops[key]()
      took = clock() - s
      if r >= 0:
        times[r, j] = took
    if r == -1:  # Results checked once: the bench times correct calls.
      assert np.array_equal(out, np.arange(1 << 18, dtype=np.float32))
  # This process's CPU time (every thread) per round of the four calls.
  cpu = (time.process_time() - cpu0) / repeats
  mine = np.concatenate([[first, ready, cpu], times.ravel()]) * 1e3
  every = np.asarray(multihost.process_allgather(mine))  # (P, 3 + R * 4)
  if me != 0:
    return
  per_call = every[:, 3:].reshape(count, repeats, len(REPEATED)).max(axis=0)
  row = {
      'P': count,
      'repeats': repeats,
      'init_s': float(np.max(stamps)),
      'first_call_ms': float(every[:, 0].max()),
      'links_ready_ms': float(every[:, 1].max()),
      'links_setup_ms': float((every[:, 1] - every[:, 0]).max()),
      'links_syncs': syncs,
      'links_usable': bool(usable),
      'cpu_ms_per_round': float(every[:, 2].mean()),
  }
  for j, key in enumerate(REPEATED):
    row[key] = float(np.median(per_call[:, j]))
    row[key.replace('_ms', '_p90_ms')] = float(
        np.percentile(per_call[:, j], 90))
  # A round's four calls: measured (sum of the medians), and what the CPU
  # alone would take if every process's CPU time ran on the machine's cores
  # one after another: P x CPU per process / cores.
  row['round_ms'] = sum(row[key] for key in REPEATED)
  row['cpu_bound_ms'] = count * row['cpu_ms_per_round'] / (os.cpu_count() or 1)
  print('SCALE_DRILL ' + json.dumps(row), flush=True)


# --------------------------------------------------------------- the driver


def run_p(p: int, args: argparse.Namespace) -> dict:
  """Launches P controllers of the worker; returns process 0's row plus the load averages."""
  sys.path.insert(0, str(ROOT))
  from multihost import launch  # noqa: PLC0415

  load0 = os.getloadavg()
  launched = time.time()
  env = {_env.PLATFORMS: 'cpu', LAUNCH_T0: repr(launched),
         _env.PYTHONPATH: os.pathsep.join(
             [str(ROOT), *filter(None, [os.environ.get(_env.PYTHONPATH)])])}
  result = launch.launch(
      [sys.executable, str(pathlib.Path(__file__).resolve()), '--worker',
       f'--repeats={args.repeats}'],
      num_processes=p, devices_per_process=1, timeout=args.timeout, env=env,
      cwd=ROOT)
  if not result.ok:
    raise RuntimeError(f'P={p} failed:\n{result.summary}\n'
                       f'{result.outputs[0][-4000:] if result.outputs else ""}')
  for line in result.outputs[0].splitlines():
    if line.startswith('SCALE_DRILL '):
      row = json.loads(line[len('SCALE_DRILL '):])
      break
  else:
    raise RuntimeError(f'P={p}: process 0 printed no result:\n'
                       f'{result.outputs[0][-4000:]}')
  row['wall_s'] = time.time() - launched
  row['load_start'] = [round(x, 2) for x in load0]
  row['load_end'] = [round(x, 2) for x in os.getloadavg()]
  return row


def fit(ps: list[int], ts: list[float], f) -> tuple[float, float, float]:
  """Least squares of t = a + b f(P): (a, b, residual sum of squares)."""
  xs = [f(p) for p in ps]
  n = len(xs)
  mx, mt = sum(xs) / n, sum(ts) / n
  sxx = sum((x - mx) ** 2 for x in xs)
  b = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx if sxx else 0.0
  a = mt - b * mx
  return a, b, sum((t - a - b * x) ** 2 for x, t in zip(xs, ts))


def slope(ps: list[int], ts: list[float]) -> float:
  """The exponent k of t ~ P^k (least squares in log-log)."""
  good = [(p, t) for p, t in zip(ps, ts) if t > 0]
  if len({p for p, _ in good}) < 2:
    return float('nan')
  _, k, _ = fit([p for p, _ in good], [math.log2(t) for _, t in good],
                math.log2)
  return k


def fits(rows: list[dict], leave_factor: float) -> list[dict]:
  """Per column: both fits, which is better, the exponent, where it leaves the docs' model."""
  ps = [r['P'] for r in rows]
  out = []
  for key, head, model in STAGES:
    ts = [r[key] for r in rows]
    la, lb, lres = fit(ps, ts, math.log2)
    pa, pb, pres = fit(ps, ts, float)
    na, nb, nres = fit(ps, ts, lambda p: p * math.log2(p))
    f = math.log2 if model == 'log' else float
    # The docs' model with the smallest P's measurement as its constant:
    # t(P) = t(P0) f(P) / f(P0) (rounds, hops or RPCs scale; each costs the
    # same as at P0).
    leaves = None
    for p, t in zip(ps[1:], ts[1:]):
      if t > leave_factor * ts[0] * f(p) / f(ps[0]):
        leaves = p
        break
    out.append({
        'stage': key, 'heading': head,
        'model': 'O(log P)' if model == 'log' else 'O(P)',
        'log2P': {'a': la, 'b': lb, 'rss': lres},
        'P': {'a': pa, 'b': pb, 'rss': pres},
        'Plog2P': {'a': na, 'b': nb, 'rss': nres},
        'better': ('tie (2 points)' if len(ps) < 3 else
                   'P' if pres < lres else 'log2 P'),
        'exponent': slope(ps, ts) if len(ps) >= 2 else float('nan'),
        'leaves_model_at': leaves,
    })
  return out


def _num(x: float) -> str:
  return f'{x:.3g}' if abs(x) < 100 else f'{x:.0f}'


def table(rows: list[dict]) -> str:
  heads = (['P', 'init s'] + [h for _, h, _ in STAGES] +
           ['round ms', 'CPU-bound round ms', 'load start', 'load end'])
  lines = ['| ' + ' | '.join(heads) + ' |', '|' + '---|' * len(heads)]
  for r in rows:
    cells = [str(r['P']), f'{r["init_s"]:.1f}']
    cells += [_num(r[k]) for k, _, _ in STAGES]
    cells += [_num(r['round_ms']), _num(r['cpu_bound_ms'])]
    cells += [' '.join(f'{x:.2f}' for x in r['load_start']),
              ' '.join(f'{x:.2f}' for x in r['load_end'])]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def fit_table(fitted: list[dict], factor: float) -> str:
  lines = ['| stage | docs\' model | t = a + b log2 P (rss) | t = a + b P (rss) '
           '| better fit | t = a + b P log2 P (rss) | t ~ P^k, k '
           f'| leaves the model at P (> {factor:g}x) |',
           '|---|---|---|---|---|---|---|---|']
  for f in fitted:
    lg, li, nl = f['log2P'], f['P'], f['Plog2P']
    lines.append(
        f'| {f["heading"]} | {f["model"]} | {lg["a"]:.3g} + {lg["b"]:.3g} '
        f'log2 P ({lg["rss"]:.3g}) | {li["a"]:.3g} + {li["b"]:.3g} P '
        f'({li["rss"]:.3g}) | {f["better"]} | {nl["a"]:.3g} + {nl["b"]:.3g} '
        f'P log2 P ({nl["rss"]:.3g}) | {f["exponent"]:.2f} | '
        f'{f["leaves_model_at"] or "-"} |')
  return '\n'.join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--processes', default='2,4,8,16,32',
                 help='comma-separated P values')
  p.add_argument('--repeats', type=int, default=50)
  p.add_argument('--out', default=None, help='write the rows and fits here')
  p.add_argument('--timeout', type=float, default=600.0,
                 help='seconds for each P')
  p.add_argument('--leave_factor', type=float, default=1.5,
                 help='measured / model extrapolation that counts as leaving')
  p.add_argument('--from_json', default=None,
                 help="print a saved run's (--out) table and fits again; "
                      'launches nothing')
  p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker:
    worker(args.repeats)
    return
  if args.from_json:
    saved = json.loads(pathlib.Path(args.from_json).read_text())
    rows, load0, load1 = saved['rows'], saved['load_start'], saved['load_end']
    args.repeats = saved['repeats']
  else:
    procs = [int(x) for x in args.processes.split(',') if x.strip()]
    load0 = os.getloadavg()
    rows = []
    for n in procs:
      rows.append(run_p(n, args))
      print(f'P={n}: ' + json.dumps(rows[-1]), flush=True)
    load1 = os.getloadavg()
  fitted = fits(rows, args.leave_factor) if len(rows) >= 2 else []
  print(f'{os.cpu_count()} cores; load at start '
        f'{" ".join(f"{x:.2f}" for x in load0)}, at end '
        f'{" ".join(f"{x:.2f}" for x in load1)}; repeats {args.repeats}')
  print(table(rows))
  if fitted:
    print()
    print(fit_table(fitted, args.leave_factor))
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(
        {'cores': os.cpu_count(), 'load_start': load0, 'load_end': load1,
         'repeats': args.repeats, 'rows': rows, 'fits': fitted}, indent=1)
        + '\n')


if __name__ == '__main__':
  main()
