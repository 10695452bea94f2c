"""Kill -> training again: the timeline of a restart of bin/train.py under `multihost.launch --max_restarts=1`.

A standalone script (run from the repository root; it starts the launcher
itself). bin/train.py runs as 2 controllers x 2 CPU devices, each on a
simulated host of its own ($RECOVERY_HOST_ID, a local-tier folder each,
as in tests/multiprocess/test_local_tier_processes.py), heartbeat timeout
5 s; process 1 SIGKILLs itself after --kill_after_step; the launcher starts
the job again and it resumes from the local tier.

  python bench/restart_drill.py --runs=3 --kill_after_step=153
  python bench/restart_drill.py --runs=3 --cache=off   # no compilation cache

(After step 153 process 0 then waits in the jitted step's gloo collective;
after step 150, the default, in the local save's agreement.)

One line per run, then the medians, in seconds (each stage ends when the
slower of the two processes reaches it):

  detect      the kill -> the launcher reaped process 1
  stop        -> the survivor (process 0) ended
  start       -> the next attempt's controllers were spawned
  import      -> process 0 started JAX's coordination service (Python,
                 imports; the others do not log theirs)
  initialize  -> `multihost.initialize()` returned (process 0's line)
  restore     -> 'Resumed from step' (the model, the data order and their
                 first compiles, the local tier's restore)
  first step  -> 'Training again' (compiling, then one step)
  total       the kill -> training again on every process

and `compile`: the XLA compile time each process logged in the restarted
attempt before its first step (`JAX_LOG_COMPILES=1`), with its number of
persistent-cache hits.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import re
import shutil
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from multihost import env as _env  # noqa: E402  (after the path is set)
from multihost import launch  # noqa: E402

TRAIN = ROOT / 'bin' / 'train.py'
STAGES = ('detect', 'stop', 'start', 'import', 'initialize', 'restore',
          'first step')
_ABSL_TIME = re.compile(r'^[IWEF](\d{4}) (\d\d:\d\d:\d\d\.\d+) ')


def _absl_time(line: str, year: int) -> float | None:
  """The wall time of an absl log line ('I1203 00:19:43.718042 ...'), or None."""
  m = _ABSL_TIME.match(line)
  if m is None:
    return None
  when = datetime.datetime.strptime(f'{year}{m.group(1)} {m.group(2)}',
                                    '%Y%m%d %H:%M:%S.%f')
  return when.timestamp()


def _first(lines: list[str], text: str, year: int) -> float | None:
  """The absl time of the first line that contains `text`."""
  for line in lines:
    if text in line:
      return _absl_time(line, year)
  return None


def _stamped(output: str, pattern: str) -> float | None:
  """The time printed at the end of the first line matching `pattern`."""
  m = re.search(pattern + r'.* at (\d+\.\d+)\.', output)
  return float(m.group(1)) if m else None


def run_once(folder: str, args: argparse.Namespace) -> dict[str, float]:
  """One drill; returns {stage: seconds, 'total', 'compile', 'hits', 'survivor'}."""
  me = f'${_env.PROCESS_ID}'  # (the shell's: each controller's index)
  command = (f'exec env {_env.RECOVERY_HOST_ID}=host{me} '
             f'"{sys.executable}" "{TRAIN}" --checkpoint_dir={folder}/ckpt '
             f'--local_checkpoint_dir={folder}/local{me} '
             f'--steps={args.steps} --save_every={args.save_every} '
             f'--local_save_every={args.local_save_every} '
             f'--drill_kill_after_step={args.kill_after_step}')
  env = {_env.HEARTBEAT: str(args.heartbeat), _env.LOG_COMPILES: '1'}
  if args.cache == 'off':
    env[_env.ENABLE_COMPILATION_CACHE] = 'false'
  if args.min_compile_time is not None:
    env[_env.CACHE_MIN_COMPILE_TIME] = str(args.min_compile_time)
  wall0, mono0 = time.time(), time.monotonic()
  cluster = launch.Controllers(['sh', '-c', command], num_processes=2,
                               devices_per_process=2, env=env, cwd=ROOT,
                               max_restarts=1)
  with cluster:
    result = cluster.wait(args.timeout)
  if not result.ok or result.restart_count != 1:
    raise RuntimeError(f'the drill did not restart once and succeed:\n'
                       f'{result.summary}')
  first, second = result.attempts
  start0 = wall0 + (cluster.run_start - mono0)
  starts = [start0 + s for s in cluster.attempt_starts]
  killed = _stamped(first.outputs[1], r'Drill: process 1 SIGKILLs itself')
  year = datetime.datetime.fromtimestamp(killed).year
  times = {
      'detect': starts[0] + first.end_times[1],
      'stop': starts[0] + first.end_times[0],
      'start': starts[1],
  }
  per_process = []
  for i in range(2):
    lines = second.outputs[i].splitlines()
    per_process.append({
        # Imports done: JAX starts (process 0) or joins the service.
        'import': _first(lines, 'Starting JAX distributed service', year)
                  or _first(lines, 'JAX distributed initialized with', year),
        'initialize': _first(lines, 'jax.distributed initialized:', year),
        'restore': _stamped(second.outputs[i], r'Resumed from step'),
        'first step': _stamped(second.outputs[i], r'Training again'),
    })
  for stage in ('import', 'initialize', 'restore', 'first step'):
    # Processes other than 0 do not log JAX's connect lines and the
    # initialized line (bin/train.py's quiet filters): those two stages end
    # when process 0 reaches them.
    seen = [p[stage] for p in per_process if p[stage] is not None]
    if not seen:
      raise RuntimeError(f'no process logged the end of stage {stage!r}; '
                         'the log lines this drill reads have changed.')
    times[stage] = max(seen)
  out, previous = {}, killed
  for stage in STAGES:
    out[stage] = times[stage] - previous
    previous = times[stage]
  out['total'] = times['first step'] - killed
  # Each process's compiles in the restarted attempt, up to its first step.
  out['compile'], out['hits'] = [], []
  for i in range(2):
    compile_s, hits = 0.0, 0
    for line in second.outputs[i].splitlines():
      if 'Training again' in line:
        break
      m = re.search(r'Finished XLA compilation of .* in ([\d.e-]+) sec',
                    line)
      if m:
        compile_s += float(m.group(1))
      hits += 'Persistent compilation cache hit' in line
    out['compile'].append(compile_s)
    out['hits'].append(hits)
  out['survivor'] = first.returncodes[0]
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--runs', type=int, default=3)
  p.add_argument('--steps', type=int, default=200)
  p.add_argument('--kill_after_step', type=int, default=150)
  p.add_argument('--save_every', type=int, default=100)
  p.add_argument('--local_save_every', type=int, default=10)
  p.add_argument('--heartbeat', type=int, default=5)
  p.add_argument('--timeout', type=float, default=300)
  p.add_argument('--cache', choices=('default', 'off'), default='default',
                 help='off: JAX_ENABLE_COMPILATION_CACHE=false for every '
                 'attempt; default: whatever the launcher does')
  p.add_argument('--min_compile_time', type=float, default=None,
                 help='JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS for the '
                 'controllers (JAX\'s default: 1 s)')
  args = p.parse_args()
  rows = []
  for k in range(args.runs):
    folder = tempfile.mkdtemp(prefix='multihost-restart-drill-')
    try:
      row = run_once(folder, args)
    finally:
      shutil.rmtree(folder, ignore_errors=True)
    rows.append(row)
    compiles = ', '.join(f'p{i} {c:.1f} s ({h} cache hits)' for i, (c, h)
                         in enumerate(zip(row['compile'], row['hits'])))
    print(f'run {k}: ' + ', '.join(f'{s} {row[s]:.1f}' for s in STAGES) +
          f'; total {row["total"]:.1f} s; compile {compiles}; survivor: '
          f'{launch.describe(row["survivor"])}', flush=True)
  if len(rows) > 1:
    med = {s: statistics.median(r[s] for r in rows)
           for s in (*STAGES, 'total')}
    slowest = statistics.median(max(r['compile']) for r in rows)
    print('median: ' + ', '.join(f'{s} {med[s]:.1f}' for s in STAGES) +
          f'; total {med["total"]:.1f} s; compile (slower process) '
          f'{slowest:.1f} s')


if __name__ == '__main__':
  main()
