"""Output: the markdown tables, the run's header line, and the JSON Lines file."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess

import jax

from bench.harness import Row
from bench.harness import Settings
import multihost


def fmt(value: float | None, digits: int = 2) -> str:
  """A time in ms with 2-3 significant digits, or 'n/a'."""
  if value is None:
    return 'n/a'
  if value >= 100:
    return f'{value:.0f}'
  if value >= 10:
    return f'{value:.1f}'
  return f'{value:.{digits}f}'


def _mib(value: int | None) -> str:
  return 'n/a' if value is None else f'{value / 2**20:.1f}'


def render(rows: list[Row]) -> str:
  """The markdown tables: comparisons, reference rows, recovery rows."""
  lines = []
  compare = [r for r in rows if r.kind == 'compare']
  if compare:
    lines += [
        '| op | payload | ours = jax | ours ms | jax ms | ours/jax | '
        'ours first ms | jax first ms | ours peak +MiB | jax peak +MiB | '
        'note |',
        '|---|---|---|---|---|---|---|---|---|---|---|']
    checked = {True: 'yes', False: '**NO**', None: '–'}
    for r in compare:
      lines.append(
          f'| {r.op} | {r.payload} | {checked[r.outputs_equal]} | '
          f'{fmt(r.ours_ms)} | {fmt(r.jax_ms)} | '
          f'{fmt(r.ratio, 3)} | {fmt(r.ours_first_ms)} | '
          f'{fmt(r.jax_first_ms)} | {_mib(r.ours_peak_bytes)} | '
          f'{_mib(r.jax_peak_bytes)} | {r.note} |')
  refs = [r for r in rows if r.kind == 'reference']
  if refs:
    lines += ['', '| reference | payload | median ms | first ms | note |',
              '|---|---|---|---|---|']
    for r in refs:
      lines.append(f'| {r.op} | {r.payload} | {fmt(r.ref_ms)} | '
                   f'{fmt(r.ref_first_ms)} | {r.note} |')
  rec = [r for r in rows if r.kind == 'recovery']
  if rec:
    lines += ['', '| recovery | state | recovery.Checkpoints ms | plain Orbax '
              'StandardCheckpointer ms | ratio | first: ours / orbax ms |',
              '|---|---|---|---|---|---|']
    for r in rec:
      lines.append(f'| {r.op[len("recovery: "):]} | {r.payload} | '
                   f'{fmt(r.ours_ms)} | {fmt(r.jax_ms)} | {fmt(r.ratio, 3)} | '
                   f'{fmt(r.ours_first_ms)} / {fmt(r.jax_first_ms)} |')
  return '\n'.join(lines)


def write_json(rows: list[Row], path: str) -> None:
  """One JSON object per row (JSON Lines)."""
  with open(path, 'w') as f:
    for r in rows:
      f.write(json.dumps(r.to_json()) + '\n')


def load() -> str:
  """The load averages, or 'n/a'."""
  try:
    return ' '.join(f'{x:.2f}' for x in os.getloadavg())
  except OSError:
    return 'n/a'


def _source() -> str:
  """The git commit of the multihost package measured, and local changes."""
  folder = os.path.dirname(os.path.dirname(os.path.abspath(multihost.__file__)))
  try:
    commit = subprocess.run(
        ['git', 'rev-parse', '--short', 'HEAD'], cwd=folder, check=True,
        capture_output=True, text=True, timeout=10).stdout.strip()
    changed = subprocess.run(
        ['git', 'status', '--porcelain', '--', 'multihost', 'recovery'],
        cwd=folder, check=True, capture_output=True, text=True,
        timeout=10).stdout.split('\n')
  except (OSError, subprocess.SubprocessError):
    return f'multihost from {folder} (not a git checkout)'
  changed = [line[3:] for line in changed if line.strip()]
  return (f'multihost from {folder} at commit {commit}'
          + (f' with local changes to {", ".join(changed)}' if changed else ''))


def header(settings: Settings) -> str:
  """The run's first lines: topology, versions, machine, load, source."""
  now = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M')
  return (f'multihost bench: {jax.process_count()} processes x '
          f'{jax.local_device_count()} {jax.devices()[0].platform} devices; '
          f'jax {jax.__version__}; python {platform.python_version()}; '
          f'{os.cpu_count()} cores; load {load()}; {now} UTC; repeats '
          f'{settings.repeats} ({max(settings.repeats, settings.small_repeats)}'
          f' up to 1 MiB), warm-up {settings.warmup}.\n{_source()}.')
