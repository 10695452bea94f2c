"""What each public call, a save (both tiers) and a restore cost per process as P grows: bytes, messages, sockets, threads, memory.

A standalone script (run from the repository root, as root: every
controller on a simulated host of its own, `multihost.launch
--hosts=netns`, so every link is TCP between hosts):

  python bench/scale_costs.py --processes=2,4,8,16 --out=/tmp/costs.jsonl

For each P it launches P controllers x 1 CPU device; each runs this file
with --worker and measures, for each case, the change over --calls calls
(after one untimed call) of its own TCP sockets' counters (getsockopt
TCP_INFO on every TCP socket the process holds: the links, its
coordination-service connection; `tcpi_bytes_sent` and
`tcpi_bytes_received`, payload bytes without TCP/IP headers; and
`tcpi_data_segs_out` / `_in`, segments that carry data, which for a call's
small frames is the number of messages), divided by the calls. The
cases: a barrier (`sync_global_devices`), `broadcast_one_to_all` of 8 B
and 1 MiB, `process_allgather` of 8 B and 64 KiB a process, `assert_equal`
of 1 KiB, `broadcast_object` of 1 KiB, `allgather_object` of ~100 B,
`host_local_array_to_global_array` of 64 KiB a process and back,
`Checkpoints.save` (persistent, synchronous) and a local-tier save of a
state whose one leaf is sharded across processes (64 KiB of blocks per
process), and `Checkpoints.start` (a restore of a 1 MiB replicated leaf,
`read_once` on and off). After the calls, each process's threads
(/proc/self/status), open fds and TCP sockets (/proc/self/fd), the sum of
its TCP sockets' buffer limits (SO_SNDBUF + SO_RCVBUF: what the kernel may
hold for them, not what it holds) and RSS. Before and after the calls
each process waits until its sockets have sent everything and had it
acknowledged (TCP_INFO's unacked and not-sent counts).

One JSON object per (P, case) in --out; a markdown table on stdout: per
call, the mean over processes, the most any process moved, and process
0's, as sent+received bytes and data segments.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import struct
import subprocess
import sys
import tempfile
import time

from multihost import env

ROOT = pathlib.Path(__file__).resolve().parents[1]
_TCP_INFO_LEN = 232


def _tcp_infos(extra=None):
  """(TCP_INFO bytes, extra(socket) or None) of each TCP socket of this process (not listening)."""
  out = []
  for name in os.listdir('/proc/self/fd'):
    try:
      if not os.readlink(f'/proc/self/fd/{name}').startswith('socket:'):
        continue
      s = socket.fromfd(int(name), socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
      continue
    try:
      info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO,
                          _TCP_INFO_LEN)
      if len(info) >= 208 and info[0] != 10:  # not listening, new enough
        out.append((info, extra(s) if extra else None))
    except OSError:
      pass  # not TCP
    finally:
      s.close()
  return out


def tcp_counters() -> tuple[int, int, int, int, int]:
  """(bytes sent, bytes received, data segments out, in, TCP sockets) over this process's TCP sockets."""
  sent = received = segs_out = segs_in = sockets = 0
  for info, _ in _tcp_infos():
    sockets += 1
    received += struct.unpack_from('Q', info, 128)[0]
    segs_in, segs_out = (segs_in + struct.unpack_from('I', info, 152)[0],
                         segs_out + struct.unpack_from('I', info, 156)[0])
    sent += struct.unpack_from('Q', info, 200)[0]
  return sent, received, segs_out, segs_in, sockets


def _drain(limit_s: float = 2.0) -> None:
  """Waits (up to `limit_s`) until every TCP socket of this process has sent and had acknowledged all it was given (a call may return before its last bytes left)."""
  end = time.monotonic() + limit_s
  while time.monotonic() < end:
    busy = any(struct.unpack_from('I', info, 24)[0]  # unacked segments
               or struct.unpack_from('I', info, 144)[0]  # not yet sent
               for info, _ in _tcp_infos())
    if not busy:
      return
    time.sleep(0.001)


def _memory() -> dict[str, int]:
  status = dict(line.split(':', 1) for line in
                open('/proc/self/status').read().splitlines() if ':' in line)
  buffers = sum(b for _, b in _tcp_infos(
      lambda s: s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
      + s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)))
  return {'threads': int(status['Threads']),
          'fds': len(os.listdir('/proc/self/fd')),
          'tcp_sockets': tcp_counters()[4],
          'tcp_buffer_limit_mib': round(buffers / 1048576, 1),
          'rss_mib': int(status['VmRSS'].split()[0]) // 1024}


def _cases(folder: str):
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  import multihost  # pylint: disable=import-outside-toplevel
  import recovery  # pylint: disable=import-outside-toplevel

  me, count = jax.process_index(), jax.process_count()
  mesh = jax.make_mesh((jax.device_count(),), ('d',))
  spec = jax.sharding.PartitionSpec
  rep = jax.sharding.NamedSharding(mesh, spec())
  rows = jax.sharding.NamedSharding(mesh, spec('d'))
  small = np.arange(2, dtype=np.int32)
  mib = np.ones(1 << 18, np.float32)
  k64 = np.full(1 << 14, me, np.float32)
  k1 = np.zeros(256, np.float32)
  obj = {'x': 'y' * 1000}
  local = np.ones((16384 // 4 * 4, 1), np.float32)[:4096]
  global_rows = multihost.host_local_array_to_global_array(
      local, mesh, spec('d'))
  whole = np.ones(1 << 18, np.float32)

  def state(step, user):
    return recovery.TransitionState(
        user=user, key=jax.random.key(0), order=np.arange(8, dtype=np.int32),
        cursor=0, epoch=0, step=step)

  replicated = state(0, {'w': jax.make_array_from_callback(
      whole.shape, rep, lambda i: whole[i])})
  sharded_blocks = np.ones((count * 16384,), np.float32)
  sharded = {'w': jax.make_array_from_callback(
      sharded_blocks.shape, rows, lambda i: sharded_blocks[i])}
  # 4 MiB of blocks a process: past the digest's 1 MiB whole-leaf bound, so
  # what moves is the peer copy (and 4 bytes a 4 MiB chunk of digest).
  large_blocks = np.ones((count * (1 << 20),), np.float32)
  sharded_large = {'w': jax.make_array_from_callback(
      large_blocks.shape, rows, lambda i: large_blocks[i])}
  persistent = recovery.Checkpoints(os.path.join(folder, 'p'),
                                    async_save=False, keep=1)
  tier = recovery.Checkpoints(
      os.path.join(folder, 'l'), async_save=False, save_every=10**6,
      local_directory=os.path.join(folder, f'local-{me}'),
      local_save_every=1, local_keep=1)
  steps = iter(range(1, 10**6))
  restore_dir = os.path.join(folder, 'r')
  with recovery.Checkpoints(restore_dir, async_save=False) as c:
    c.save(state(1, replicated.user), force=True)

  def restore(read_once):
    with recovery.Checkpoints(restore_dir, read_once=read_once) as c:
      c.start(replicated, resume=True)

  return [
      ('idle 50 ms', lambda: time.sleep(0.05)),
      ('sync_global_devices', lambda: multihost.sync_global_devices('c')),
      ('broadcast_one_to_all 8 B', lambda: multihost.broadcast_one_to_all(
          small)),
      ('broadcast_one_to_all 1 MiB', lambda: multihost.broadcast_one_to_all(
          mib)),
      ('process_allgather 8 B', lambda: multihost.process_allgather(small)),
      ('process_allgather 64 KiB', lambda: multihost.process_allgather(k64)),
      ('assert_equal 1 KiB', lambda: multihost.assert_equal(k1)),
      ('broadcast_object 1 KiB', lambda: multihost.broadcast_object(obj)),
      ('allgather_object ~100 B', lambda: multihost.allgather_object(
          ('p', me, 'x' * 80))),
      ('host_local_array_to_global_array 64 KiB',
       lambda: multihost.host_local_array_to_global_array(
           local, mesh, spec('d'))),
      ('global_array_to_host_local_array 64 KiB',
       lambda: multihost.global_array_to_host_local_array(
           global_rows, mesh, spec('d'))),
      ('persistent save, 1 MiB replicated',
       lambda: persistent.save(state(next(steps), replicated.user),
                               force=True)),
      ('local save, 64 KiB blocks a process (one small leaf)',
       lambda: tier.save(state(next(steps), sharded))),
      ('local save, 4 MiB blocks a process',
       lambda: tier.save(state(next(steps), sharded_large))),
      ('restore, 1 MiB replicated, read_once', lambda: restore(True)),
      ('restore, 1 MiB replicated, every process reads',
       lambda: restore(False)),
  ], (persistent, tier)


def _worker(args) -> None:
  import jax  # pylint: disable=import-outside-toplevel

  import multihost  # pylint: disable=import-outside-toplevel

  multihost.initialize()
  for _ in range(3):  # the links come up after the first calls
    multihost.sync_global_devices('warm')
  cases, closing = _cases(args.folder)
  results = []
  for name, call in cases:
    if args.only and not any(o in name for o in args.only.split(',')):
      continue
    call()
    multihost.sync_global_devices('case')
    _drain()
    before = tcp_counters()
    for _ in range(args.calls):
      call()
    _drain()
    after = tcp_counters()
    multihost.sync_global_devices('case-end')
    delta = [(a - b) / args.calls for a, b in zip(after[:4], before[:4],
                                                  strict=True)]
    results.append((name, delta))
  for c in closing:
    c.close()
  everyone = multihost.allgather_object((results, _memory()))
  if jax.process_index() != 0:
    return
  count = jax.process_count()
  with open(args.out, 'a', encoding='utf-8') as f:
    for i, (name, _) in enumerate(results):
      per = [r[i][1] for r, _ in everyone]
      moved = [s + r for s, r, _, _ in per]
      segs = [o + n for _, _, o, n in per]
      f.write(json.dumps({
          'processes': count, 'case': name,
          'bytes_mean': sum(moved) / count, 'bytes_max': max(moved),
          'bytes_p0': moved[0], 'segs_mean': sum(segs) / count,
          'segs_max': max(segs), 'segs_p0': segs[0],
          'per_process': per}) + '\n')
    memory = [m for _, m in everyone]
    f.write(json.dumps({
        'processes': count, 'case': 'memory',
        **{k: [m[k] for m in memory] for k in memory[0]}}) + '\n')


def _table(rows: list[dict]) -> str:
  cases = list(dict.fromkeys(r['case'] for r in rows if r['case'] != 'memory'))
  ps = sorted({r['processes'] for r in rows})
  by = {(r['processes'], r['case']): r for r in rows}
  out = ['| per call, per process: bytes sent+received (mean / most / '
         'process 0), data segments (mean / most / p0) | ' +
         ' | '.join(f'P={p}' for p in ps) + ' |',
         '|---|' + '---|' * len(ps)]

  def short(n):
    return (f'{n / 1048576:.2f}M' if n >= 1048576 else
            f'{n / 1024:.1f}K' if n >= 1024 else f'{n:.0f}')

  for case in cases:
    cells = []
    for p in ps:
      r = by.get((p, case))
      cells.append('' if r is None else
                   f"{short(r['bytes_mean'])} / {short(r['bytes_max'])} / "
                   f"{short(r['bytes_p0'])}; {r['segs_mean']:.0f} / "
                   f"{r['segs_max']:.0f} / {r['segs_p0']:.0f}")
    out.append(f'| {case} | ' + ' | '.join(cells) + ' |')
  for key in ('threads', 'fds', 'tcp_sockets', 'tcp_buffer_limit_mib',
              'rss_mib'):
    cells = []
    for p in ps:
      r = by.get((p, 'memory'))
      cells.append('' if r is None else
                   f"{min(r[key])}-{max(r[key])} (p0 {r[key][0]})")
    out.append(f'| {key} per process (min-max) | ' + ' | '.join(cells) + ' |')
  return '\n'.join(out)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--processes', default='2,4,8,16')
  parser.add_argument('--calls', type=int, default=3)
  parser.add_argument('--only', default='', help='cases whose name holds '
                      'one of these comma-separated words')
  parser.add_argument('--out', default='/tmp/scale_costs.jsonl')
  parser.add_argument('--hosts', default='netns',
                      help="'netns' (needs root) or '' (loopback, one host)")
  parser.add_argument('--timeout', type=float, default=500)
  parser.add_argument('--worker', action='store_true')
  parser.add_argument('--folder')
  parser.add_argument('--table', help='print the table of this JSON file')
  args = parser.parse_args()
  if args.worker:
    _worker(args)
    return
  if args.table:
    print(_table([json.loads(line) for line in open(args.table)]))
    return
  if os.path.exists(args.out):
    os.remove(args.out)
  for p in [int(x) for x in args.processes.split(',')]:
    with tempfile.TemporaryDirectory(prefix='scale-costs-') as tmp:
      command = [
          sys.executable, '-m', 'multihost.launch', f'--num_processes={p}',
          '--devices_per_process=1', f'--timeout={args.timeout}',
          *([f'--hosts={args.hosts}'] if args.hosts else []), '--',
          sys.executable, os.path.abspath(__file__), '--worker',
          f'--folder={tmp}', f'--calls={args.calls}', f'--out={args.out}',
          f'--only={args.only}']
      out = subprocess.run(
          command, cwd=ROOT, capture_output=True, text=True,
          timeout=args.timeout + 60,
          env={**os.environ, env.PLATFORMS: 'cpu', env.LOCAL_LINKS: '0'})
      if out.returncode:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(f'P={p}: exit status {out.returncode}')
      print(f'P={p} done', file=sys.stderr, flush=True)
  print(_table([json.loads(line) for line in open(args.out)]))


if __name__ == '__main__':
  main()
