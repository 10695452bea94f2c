"""Where an oversubscribed call's time goes, at any P: a controller program for `multihost.launch` that measures every process's CPU time per call, ours against torch gloo.

  python -m multihost.launch --num_processes=8 -- python bench/cpu_share.py

When P processes share fewer cores, a call is as fast as the CPU time all
processes spend on it allows: its wall time is at least that sum over the
cores. In the same processes, in interleaved rounds (the side that goes
first alternating), each case back to back (`--calls` per round), per
call: the wall time (median over rounds of the slowest process), each
process's CPU time (`time.process_time`: every thread) and its voluntary
context switches (sleeps: waits for a peer), for ours and, where torch is
importable, for torch.distributed gloo on the same payload (broadcast in
place into a preallocated tensor). The table gives the sum of the CPU
times, that sum over the cores (the floor it sets on the wall time), the
source's (process 0's) and the largest other process's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402  pylint: disable=g-import-not-at-top
from bench.harness import Settings  # noqa: E402
import multihost  # noqa: E402

MiB = 1 << 20


def _cases(dist, ops: list[str], sizes: list[int]) -> list[tuple[str, object,
                                                                 object]]:
  """(name, ours, torch's or None) for each op and size."""
  me = jax.process_index()
  cases = []
  if 'barrier' in ops:
    cases.append(('barrier', lambda: multihost.sync_global_devices('b'),
                  dist and dist.barrier))
  for n in sizes:
    x = np.full(max(1, n // 4), me, np.float32)
    t = None
    if dist is not None:
      import torch  # pylint: disable=import-outside-toplevel
      t = torch.full((max(1, n // 4),), float(me))
    if 'broadcast' in ops:
      cases.append((f'broadcast {harness.format_size(n)}',
                    lambda x=x: multihost.broadcast_one_to_all(x),
                    dist and (lambda t=t: dist.broadcast(t, 0))))
    if 'all-gather' in ops:
      outs = [] if t is None else [t.clone() for _ in range(jax.process_count())]
      cases.append((f'all-gather {harness.format_size(n)}',
                    lambda x=x: multihost.process_allgather(x),
                    dist and (lambda t=t, outs=outs: dist.all_gather(outs, t))))
  return cases


def _size(text: str) -> int:
  text = text.strip().lower()
  for unit, scale in (('mib', MiB), ('kib', 1 << 10)):
    if text.endswith(unit):
      return int(float(text[:-len(unit)]) * scale)
  return int(text)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--ops', default='barrier,broadcast',
                      help='comma-separated: barrier, broadcast, all-gather')
  parser.add_argument('--sizes', default='8,1MiB',
                      help='payload sizes of the broadcasts and all-gathers')
  parser.add_argument('--calls', type=int, default=20,
                      help='back-to-back calls of each case per round')
  parser.add_argument('--rounds', type=int, default=7)
  parser.add_argument('--torch', action=argparse.BooleanOptionalAction,
                      default=True, help='also time torch gloo (if importable)')
  parser.add_argument('--json', default='',
                      help='also write the rows here (process 0)')
  args = parser.parse_args()
  ops = [op.strip() for op in args.ops.split(',') if op.strip()]
  unknown = sorted(set(ops) - {'barrier', 'broadcast', 'all-gather'})
  if unknown:
    raise SystemExit(f'bench/cpu_share.py: unknown --ops {unknown}; choose '
                     'from barrier, broadcast, all-gather.')
  multihost.initialize()
  settings = Settings()
  count, cores = jax.process_count(), os.cpu_count() or 1
  dist = harness.torch_group(settings) if args.torch else None
  cases = _cases(dist, ops, [_size(s) for s in args.sizes.split(',')])
  sides = ('ours', 'torch')
  for _, *fns in cases:  # Warm-up: connections, compiles, caches.
    for fn in fns:
      for _ in range(3 if fn is not None else 0):
        fn()
  # (round, case, side, [wall, cpu, sleeps]); NaN where torch is absent.
  samples = np.full((args.rounds, len(cases), 2, 3), np.nan)
  for r in range(args.rounds):
    for c, (_, *fns) in enumerate(cases):
      order = (0, 1) if r % 2 == 0 else (1, 0)
      for side in order:
        if fns[side] is not None:
          samples[r, c, side] = harness.usage_per_call(fns[side], args.calls,
                                                        settings)
  every = multihost.process_allgather(samples)  # (process, round, ...)
  if dist is not None:
    dist.destroy_process_group()
  if jax.process_index() != 0:
    return
  wall = np.median(every[..., 0].max(axis=0), axis=0)  # (case, side)
  cpu = np.median(every[..., 1], axis=1)  # (process, case, side)
  sleeps = np.median(every[..., 2], axis=1)
  print(f'Per call at P={count} on {cores} cores, medians of {args.rounds} '
        f'interleaved rounds of {args.calls} back-to-back calls (load '
        f'{os.getloadavg()[0]:.2f}):\n')
  print('| case | side | wall ms | CPU ms, all processes | over the cores '
        '| CPU ms p0 | CPU ms, most of the others | sleeps per process |')
  print('|---|---|---|---|---|---|---|---|')
  rows = []
  for c, (name, *fns) in enumerate(cases):
    for side in range(2):
      if fns[side] is None:
        continue
      per_process = [float(v) for v in cpu[:, c, side]]
      total = sum(per_process)
      others = max(per_process[1:]) if count > 1 else 0.0
      naps = float(np.mean(sleeps[:, c, side]))
      print(f'| {name} | {sides[side]} | {wall[c, side]:.3f} | {total:.3f} | '
            f'{total / cores:.3f} | {per_process[0]:.3f} | {others:.3f} | '
            f'{naps:.2f} |')
      rows.append({'case': name, 'side': sides[side],
                   'wall_ms': float(wall[c, side]), 'cpu_ms': per_process,
                   'cpu_total_ms': total, 'cores': cores,
                   'sleeps': [float(v) for v in sleeps[:, c, side]]})
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump({'processes': count, 'calls': args.calls,
                 'rounds': args.rounds, 'rows': rows}, f, indent=1)


if __name__ == '__main__':
  main()
