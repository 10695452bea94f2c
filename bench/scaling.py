"""The one-command report: the targets at P=2, the side-by-side and soak tables, a P-scaling table and the model.

`python bin/bench.py --report=FILE` (not under the launcher) starts
`bin/bench.py --versus` at each P under `multihost.launch` (at P=2 with
the soak too), reads their JSON rows, and writes one markdown report, with
the P-scaling data beside it as JSON (`data_path`) for
`bin/plot.py --scaling`.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from bench import model
from bench import report as report_lib
from bench import soak
from bench import versus
from multihost import env
from multihost import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = str(ROOT / 'bin' / 'bench.py')


def _run(processes: int, args: list[str], timeout: float,
         env: dict[str, str] | None = None) -> list[dict]:
  with tempfile.TemporaryDirectory(prefix='multihost-bench-') as tmp:
    out = os.path.join(tmp, 'rows.jsonl')
    result = launch.launch([sys.executable, BENCH, '--ops=', *args,
                            f'--json={out}'],
                           num_processes=processes, devices_per_process=1,
                           timeout=timeout, cwd=ROOT, stream=sys.stderr,
                           env=env)
    if not result.ok:
      raise RuntimeError(f'bench at P={processes} failed:\n{result.summary}')
    with open(out) as f:
      return [json.loads(line) for line in f]


def alone(processes: int, args: list[str], *, launches: int,
          timeout: float) -> list[versus.Result]:
  """Each compared case with each side alone: `launches` launches of ours (torch not imported) and as many of torch gloo's, alternating (ours first, then torch first, ...).

  Named `versus.ALONE`; a side's times are its launches' medians (so its
  median is over launches). Ours and torch share no process, as in the
  issue's own harness; in the same processes (`versus.run`'s default)
  each side's calls ran beside the other's threads, sockets and caches.
  """
  times: dict[str, dict[str, list[float]]] = {}
  sizes: dict[str, int] = {}
  for k in range(launches):
    for side in ('ours', 'torch') if k % 2 == 0 else ('torch', 'ours'):
      for r in _results(_run(processes, [*args, f'--versus_side={side}'],
                             timeout)):
        ms = r.ours_ms if side == 'ours' else r.torch_ms
        if ms is not None:
          times.setdefault(r.name, {'ours': [], 'torch': []})[side].append(ms)
          sizes[r.name] = r.nbytes
  return [versus.Result(name + versus.ALONE, sizes[name], t['ours'],
                        t['torch'])
          for name, t in times.items() if t['ours'] and t['torch']]


def _results(rows: list[dict]) -> list[versus.Result]:
  return [versus.Result(r['op'], r['payload_bytes'], r['ours_times_ms'],
                        r['torch_times_ms'])
          for r in rows if r.get('kind') == 'versus']


def _commit() -> str:
  try:
    return subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT,
                          capture_output=True, text=True,
                          check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return 'unknown'


def scaling_table(by_p: dict[int, list[versus.Result]]) -> str:
  """Per case, ours and torch gloo's median ms at each P."""
  ps = sorted(by_p)
  names = []
  for p in ps:  # The CPU-busy rows are P=2's alone: in its own table.
    names += [r.name for r in by_p[p]
              if r.name not in names and not r.name.endswith(versus.BUSY)]
  f = versus._fmt  # pylint: disable=protected-access
  head = ' | '.join(f'P={p} ours | P={p} torch' for p in ps)
  lines = [f'| case | {head} |', '|---|' + '---|' * (2 * len(ps))]
  for name in names:
    cells = []
    for p in ps:
      r = next((r for r in by_p[p] if r.name == name), None)
      cells += ([f(r.ours_ms), f(r.torch_ms)] if r else ['–', '–'])
    lines.append(f'| {name} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def data_path(path: str) -> str:
  """Where `report(path)` writes its data: `path` with its extension replaced by .json (a report named *.json gets *.json.json)."""
  base, ext = os.path.splitext(path)
  return path + '.json' if ext == '.json' else base + '.json'


def _ms(value: float | None) -> float | None:
  return None if value is None else float(f'{value:.4g}')


def scaling_data(by_p: dict[int, list[versus.Result]], **about) -> dict:
  """What `bin/plot.py --scaling` draws: `about` (the run: commit, date, cores, ...) and a list `rows`, one per case and P.

  A row: `processes`, `op`, `payload_bytes`, `busy` (a CPU-busy case),
  `ours_ms` and `torch_ms` (medians over rounds, over launches for the
  `versus.ALONE` rows; 4 significant digits;
  torch_ms None for ours alone: the raw stream and the round trip) and
  `rounds`. The per-round times are left out.
  """
  rows = [{'processes': p, 'op': r.name, 'payload_bytes': r.nbytes,
           'busy': r.name.endswith(versus.BUSY), 'ours_ms': _ms(r.ours_ms),
           'torch_ms': _ms(r.torch_ms), 'rounds': len(r.ours)}
          for p in sorted(by_p) for r in by_p[p]]
  return {**about, 'rows': rows}


# `contended`'s cases, as issue 65 times them: (P, the `bin/bench.py`
# arguments that time them).
CONTENDED = (
    (2, ['--versus_sizes=8,1MiB', '--versus_ops=broadcast', '--versus_busy',
         '--noversus_idle']),
    (4, ['--versus_sizes=8', '--versus_ops=broadcast']))


def contended(path: str, *, rounds: int, soak_calls: int = 0,
              alone_launches: int = 2) -> str:
  """The rows where a training host's cores are contended, alone: broadcasts of 8 B and 1 MiB at P=2 with one spinning process per core, and of 8 B at P=4.

  Each in the same processes (interleaved rounds) and with each side alone
  (`alone`, `alone_launches` launches of each); writes the table to
  `path` and the rows to `data_path(path)`, as `report` does. About two
  minutes here (`bin/bench.py --report_cases=contended`).
  """
  del soak_calls  # (no soak among these rows)
  by_p: dict[int, list[versus.Result]] = {}
  for p, args in CONTENDED:
    args = [f'--versus={rounds}', *args]
    by_p[p] = _results(_run(p, args, timeout=1200))
    by_p[p] += alone(p, args, launches=alone_launches, timeout=1200)
  about = _about(path, rounds, 0, 'contended')
  with open(data_path(path), 'w') as f:
    json.dump(scaling_data(by_p, **about), f, indent=1)
    f.write('\n')
  f = versus._fmt  # pylint: disable=protected-access
  lines = [f'Commit {about["commit"]}, {about["date"]}, {about["cores"]} '
           f'cores, load at the end {about["load"]}. Command: '
           f'`{about["command"]}`.', '',
           '| P | case | ours ms | torch gloo ms | ours / torch |',
           '|---|---|---|---|---|']
  for p in sorted(by_p):
    for r in by_p[p]:
      ratio = r.ours_ms / r.torch_ms if r.ours_ms and r.torch_ms else None
      lines.append(f'| {p} | {r.name} | {f(r.ours_ms)} | {f(r.torch_ms)} | '
                   f'{f(ratio, 3)} |')
  text = '\n'.join(lines) + '\n'
  with open(path, 'w') as out:
    out.write(text)
  return text


def _about(path: str, rounds: int, soak_calls: int, cases: str) -> dict:
  """The run's facts for the data file: commit, date, cores, load, command."""
  command = (f'python bin/bench.py --report={path} '
             f'--report_rounds={rounds} --report_soak={soak_calls}')
  if cases != 'all':
    command = (f'python bin/bench.py --report={path} --report_cases={cases} '
               f'--report_rounds={rounds}')
  return {
      'commit': _commit(),
      'date': datetime.datetime.now(datetime.timezone.utc).strftime(
          '%Y-%m-%d %H:%M UTC'),
      'cores': os.cpu_count(), 'load': report_lib.load(), 'command': command}


def report(path: str, *, rounds: int, soak_calls: int,
           processes: tuple[int, ...] = (2, 4, 8),
           small_at: int = 8, alone_launches: int = 2) -> str:
  """Runs every part, writes the markdown report to `path`, returns it.

  The P-scaling data go to `data_path(path)` (see `scaling_data`). At
  P >= `small_at` the 64 MiB cases are left out (memory and time on
  this machine's cores); the scaling table marks them '–'. At P > 2 the
  cases up to 1 MiB are also timed with each side alone (`alone`,
  `alone_launches` launches of each; 0: not).
  """
  by_p: dict[int, list[versus.Result]] = {}
  soak_rows = None
  for p in processes:
    # As many rounds at every P: each case's median at P=4 and 8 is as
    # steady as at P=2 (a third as many rounds let torch's 1 MiB broadcast
    # at P=4 over TCP move from 0.94 to 1.49 ms between three runs).
    args = [f'--versus={rounds}']
    if p >= small_at:
      args.append('--versus_sizes=8,1MiB')
    if p == 2:
      args.append('--versus_busy')
      if soak_calls:
        args.append(f'--soak={soak_calls}')
    rows = _run(p, args, timeout=3600)
    by_p[p] = _results(rows)
    # The compared cases again with every link over TCP, as between hosts
    # (on one host the links are local sockets): rows named `OVER_TCP`.
    tcp = _run(p, [a for a in args if a.startswith('--versus')
                   and a != '--versus_busy'], timeout=3600,
               env={env.LOCAL_LINKS: '0'})
    by_p[p] += [versus.Result(r.name + versus.OVER_TCP, r.nbytes, r.ours,
                              r.torch)
                for r in _results(tcp) if r.torch]
    if p > 2 and alone_launches:
      by_p[p] += alone(p, [args[0], '--versus_sizes=8,1MiB'],
                       launches=alone_launches, timeout=3600)
    if p == 2:
      soak_rows = [r for r in rows if r.get('kind') == 'soak'] or None
  about = _about(path, rounds, soak_calls, 'all')
  data = data_path(path)
  with open(data, 'w') as f:
    json.dump(scaling_data(by_p, **about), f, indent=1)
    f.write('\n')
  parts = [
      f'Commit {about["commit"]}, {about["date"]}, {about["cores"]} cores, '
      f'load at the end {about["load"]}. Command: `{about["command"]}`.',
      '', '### Targets (P=2)', '',
      versus.render_targets(versus.targets(by_p.get(2, []), soak_rows)),
  ]
  if 2 in by_p:
    parts += ['', '### Side by side at P=2 (ms per call, medians of '
              f'{rounds} interleaved rounds, slowest process)', '',
              versus.render(by_p[2])]
  if soak_rows:
    parts += ['', f'### Soak at P=2 ({soak_rows[-1]["calls"]} mixed calls; '
              'process 0 hosts the coordination service)', '',
              soak.render(soak_rows)]
  cores = about['cores']
  over = [p for p in sorted(by_p) if p > 2 and (cores is None or p > cores)]
  parts += ['', '### P-scaling (ms per call; '
            + (f'P={" and P=".join(map(str, over))} run oversubscribed on '
               if over else 'a core per process at every P: ')
            + f'{cores} cores)', '',
            scaling_table(by_p), '',
            f'Rows ending "{versus.ALONE.strip()}": each side in launches of '
            'its own (torch not imported in ours), alternating, medians over '
            'launches; the other rows: both sides in the same processes, '
            f'medians of {rounds} interleaved rounds at every P.', '',
            f'The data (medians per case and P): `{data}`; '
            f'`python bin/plot.py --scaling={data} --out=scaling.png` '
            'draws them against P.',
            '', '### Model: one call at large P (analytic)', '',
            model.render(model.rows())]
  text = '\n'.join(parts) + '\n'
  with open(path, 'w') as f:
    f.write(text)
  return text
