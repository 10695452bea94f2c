"""Storage bytes a persistent restore reads, and its time, with and without `read_once`, against P.

A standalone script (run from the repository root; it starts the launcher
itself, once per P and mode):

  python bench/restore_reads.py --processes=2,4,8 --mb=32 --repeats=3

Each run: P controllers x 1 CPU device; a state of one float32 array of
--mb MiB (random, so nothing compresses), replicated across every process,
saved once by `recovery.Checkpoints`; then --repeats times a fresh
`Checkpoints(..., read_once=...)` and `start(resume=True)`, each
process counting:

  storage  its `Checkpoints.read_from_storage`: /proc/self/io `rchar`
           across Orbax's read (page-cache hits count: bytes asked of
           storage; no data-plane bytes move in that span);
  rchar    its `rchar` across the whole `start` (data-plane socket reads
           by read/readv count too);
  s        the slowest process's wall time of `start`.

It checks that every process restored the saved bits (a digest of the
bytes, all-gathered). One JSON line per run on stdout; a markdown table at
the end. The job's storage bytes are the sum over processes; the table
gives them as a multiple of the state's size. On one machine every read
after the first is a page-cache hit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from multihost import env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _worker(args) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  import multihost  # pylint: disable=import-outside-toplevel
  import recovery  # pylint: disable=import-outside-toplevel
  from recovery._src.checkpoint import read_once  # pylint: disable=import-outside-toplevel

  multihost.initialize()
  n = args.mb * (1 << 20) // 4
  mesh = jax.make_mesh((jax.device_count(),), ('d',))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  host = np.random.default_rng(0).standard_normal(n, dtype=np.float32)

  def state(values):
    w = jax.make_array_from_callback(values.shape, rep, lambda i: values[i])
    return recovery.TransitionState(
        user={'w': w}, key=jax.random.key(0),
        order=np.arange(8, dtype=np.int32), cursor=0, epoch=0, step=1)

  with recovery.Checkpoints(args.folder, async_save=False) as ckpt:
    ckpt.save(state(host), force=True)
  want = hashlib.sha256(host.tobytes()).hexdigest()
  initial = state(np.zeros(n, np.float32))
  rows = []
  for _ in range(args.repeats):
    multihost.sync_global_devices('restore_reads')
    r0, t0 = read_once.bytes_read(), time.perf_counter()
    with recovery.Checkpoints(args.folder, read_once=args.read_once) as ckpt:
      got = ckpt.start(initial, resume=True)
      seconds = time.perf_counter() - t0
      rchar = read_once.bytes_read() - r0
      storage = ckpt.read_from_storage
    local = np.asarray(got.user['w'].addressable_shards[0].data)
    same = hashlib.sha256(local.tobytes()).hexdigest() == want
    rows.append(multihost.allgather_object((storage, rchar, seconds, same)))
  if jax.process_index() == 0:
    state_bytes = n * 4
    storage = [sum(r[0] for r in row) for row in rows]
    print(json.dumps({
        'processes': jax.process_count(), 'read_once': args.read_once,
        'state_bytes': state_bytes,
        'storage_per_job': statistics.median(storage) / state_bytes,
        'storage_max_process': max(max(r[0] for r in row) for row in rows)
                               / state_bytes,
        'rchar_max_process': max(max(r[1] for r in row) for row in rows)
                             / state_bytes,
        'seconds': statistics.median(max(r[2] for r in row) for row in rows),
        'bits_equal': all(all(r[3] for r in row) for row in rows)}),
          flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--processes', default='2,4,8')
  parser.add_argument('--mb', type=int, default=32)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--modes', default='once,every')
  parser.add_argument('--timeout', type=float, default=300)
  parser.add_argument('--worker', action='store_true')
  parser.add_argument('--folder')
  parser.add_argument('--read_once', type=int, default=1)
  args = parser.parse_args()
  if args.worker:
    args.read_once = bool(args.read_once)
    _worker(args)
    return
  results = []
  for p in [int(x) for x in args.processes.split(',')]:
    for mode in args.modes.split(','):
      with tempfile.TemporaryDirectory(prefix='restore-reads-') as tmp:
        command = [
            sys.executable, '-m', 'multihost.launch', f'--num_processes={p}',
            '--devices_per_process=1', f'--timeout={args.timeout}', '--',
            sys.executable, os.path.abspath(__file__), '--worker',
            f'--folder={tmp}/ckpt', f'--mb={args.mb}',
            f'--repeats={args.repeats}',
            f'--read_once={int(mode == "once")}']
        out = subprocess.run(command, cwd=ROOT, capture_output=True,
                             text=True, timeout=args.timeout + 60,
                             env={**os.environ, env.PLATFORMS: 'cpu'})
        lines = [line for line in out.stdout.splitlines()
                 if line.startswith('{') or line.startswith('[p0] {')]
        if out.returncode or not lines:
          sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
          raise SystemExit(f'P={p} {mode}: exit status {out.returncode}')
        row = json.loads(lines[-1].split(' ', 1)[1]
                         if lines[-1].startswith('[p0]') else lines[-1])
        print(json.dumps(row), flush=True)
        results.append(row)
  print('\n| P | read | storage bytes per job (x state) | most by one process '
        '| most read() bytes by one process, whole start | start s | bits '
        'equal |\n|---|---|---|---|---|---|---|')
  for r in results:
    print(f"| {r['processes']} | {'once' if r['read_once'] else 'every'} | "
          f"{r['storage_per_job']:.2f} | {r['storage_max_process']:.2f} | "
          f"{r['rchar_max_process']:.2f} | {r['seconds']:.2f} | "
          f"{r['bits_equal']} |")


if __name__ == '__main__':
  main()
