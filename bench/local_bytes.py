"""Bytes the local tier moves per process per local save, at each process count: loopback bytes in a private network namespace, a run with the local tier minus the same run without it.

Each P: `bin/train.py --shard_params` under `python -m multihost.launch`,
each process its own host ($RECOVERY_HOST_ID and a local folder of its
own), the links over TCP ($MULTIHOST_LOCAL_LINKS=0), twice in a fresh
network namespace (`unshare -n`, only `lo` up): once with
`--local_checkpoint_dir=... --local_save_every=K`, once without. Every byte
between the processes crosses `lo`, whose received-bytes counter is read
before and after each run (from /proc/net/dev: sysfs shows the
counters of the namespace it was mounted in). S, a process's own blocks that need a peer
copy, is what the tier logs it sent to a peer per save (--verbosity=1).
The ratio is (bytes with - bytes without) / P / saves / S.

  python bench/local_bytes.py --processes=2,4,8 --width=2097152

Needs root (`unshare -n`) and `ip`. Prints one row per P, and with --json
writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile

from multihost import env as env_lib
from recovery import HOST_ID_VARIABLE

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The namespace's own counters: /proc/net/dev (sysfs keeps showing the
# namespace it was mounted in). lo's received bytes: its first number.
_COUNTER = "awk '/^ *lo:/ {print $2}' /proc/net/dev"
_SAVED = re.compile(r'\[p(\d+)\].*Local save of step (\d+) to .*: (\d+) own '
                    r'and (\d+) peer bytes, (\d+) bytes sent to a peer')


def run(count: int, *, width: int, steps: int, every: int, local: bool,
        folder: pathlib.Path, timeout: float) -> dict:
  """One run of the trainer in a fresh network namespace: lo's received bytes across it, and the local saves it logged."""
  args = [f'--checkpoint_dir={folder}/ckpt', f'--steps={steps}',
          '--save_every=1000', f'--width={width}',
          # (The batch is sharded over every device: one or more rows each.)
          f'--samples={max(8, count)}', f'--batch_size={max(8, count)}',
          '--shard_params', '--verbosity=1',
          '--num_cpu_devices=1']
  if local:
    args += [f'--local_checkpoint_dir={folder}/local$JAX_PROCESS_ID',
             f'--local_save_every={every}']
  train = (f'exec env {HOST_ID_VARIABLE}=host$JAX_PROCESS_ID '
           f'{shlex.quote(sys.executable)} {ROOT}/bin/train.py '
           + ' '.join(args))
  launcher = [sys.executable, '-m', 'multihost.launch',
              f'--num_processes={count}', '--devices_per_process=1', '--',
              'sh', '-c', train]
  script = (f'ip link set lo up && echo RX $({_COUNTER}) && '
            f'{shlex.join(launcher)}; status=$?; echo RX $({_COUNTER}); '
            'exit $status')
  env = {**os.environ, env_lib.LOCAL_LINKS: '0'}
  env.pop(HOST_ID_VARIABLE, None)
  done = subprocess.run(['unshare', '-n', 'sh', '-c', script], env=env,
                        cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout, check=False)
  out = done.stdout + done.stderr
  if done.returncode != 0:
    raise RuntimeError(f'P={count} local={local}: exit status '
                       f'{done.returncode}\n{out[-4000:]}')
  rx = [int(n) for n in re.findall(r'^RX (\d+)$', done.stdout, re.M)]
  saves = [tuple(map(int, m)) for m in _SAVED.findall(out)]
  return {'bytes': rx[1] - rx[0], 'saves': saves}


def measure(count: int, **kwargs) -> dict:
  """The row for `count` processes (see the module docstring)."""
  with tempfile.TemporaryDirectory(prefix='local-bytes-') as tmp:
    base = pathlib.Path(tmp)
    (base / 'with').mkdir()
    (base / 'without').mkdir()
    tier = run(count, local=True, folder=base / 'with', **kwargs)
    plain = run(count, local=False, folder=base / 'without', **kwargs)
  saves = tier['saves']
  per_save = len({step for _, step, *_ in saves})
  own = sum(s[2] for s in saves) / len(saves)
  sent = sum(s[4] for s in saves) / len(saves)  # S
  moved = (tier['bytes'] - plain['bytes']) / count / per_save
  return {'processes': count, 'local_saves': per_save,
          'own_bytes': own, 'blocks_sent_to_peer_S': sent,
          'lo_bytes_with': tier['bytes'], 'lo_bytes_without': plain['bytes'],
          'moved_per_process_per_save': moved, 'ratio_to_S': moved / sent}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--processes', default='2,4,8')
  parser.add_argument('--width', type=int, default=1 << 21)
  parser.add_argument('--steps', type=int, default=20)
  parser.add_argument('--every', type=int, default=5)
  parser.add_argument('--timeout', type=float, default=600)
  parser.add_argument('--json', default='')
  flags = parser.parse_args()
  rows = []
  print('| P | local saves | S (bytes a process sends a peer, per save) | '
        'moved per process per save | / S |\n|---|---|---|---|---|',
        flush=True)
  for count in (int(p) for p in flags.processes.split(',')):
    row = measure(count, width=flags.width, steps=flags.steps,
                  every=flags.every, timeout=flags.timeout)
    rows.append(row)
    print(f"| {count} | {row['local_saves']} | "
          f"{row['blocks_sent_to_peer_S']:.0f} | "
          f"{row['moved_per_process_per_save']:.0f} | "
          f"{row['ratio_to_S']:.3f} |", flush=True)
  if flags.json:
    pathlib.Path(flags.json).write_text(
        json.dumps({'width': flags.width, 'steps': flags.steps,
                    'every': flags.every, 'rows': rows}, indent=1) + '\n')


if __name__ == '__main__':
  main()
