"""The soak: many mixed collectives back to back; every process's RSS, open fds and threads along the way.

Not a timed test: it shows whether anything grows per call. The mix is a
barrier, small broadcasts and all-gathers, the object collectives and
assert_equal; process 0 also hosts the coordination service, so its RSS
includes what the service keeps per call.
"""

from __future__ import annotations

from collections.abc import Callable
import gc
import os
import threading
import time

import jax
import numpy as np

import multihost

# Where the soak reports, as fractions of the whole run (10% is the base of
# the growth target: "from call 10 000 to call 100 000").
POINTS = (0.01, 0.1, 0.25, 0.5, 0.75, 1.0)
RSS_GROWTH_LIMIT = 4 << 20


def _status(field: str) -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field + ':'):
        return int(line.split()[1])
  return -1


def sample() -> dict:
  """This process's RSS (bytes), open fds, OS threads and Python threads."""
  gc.collect()
  return {'rss': _status('VmRSS') * 1024,
          'fds': len(os.listdir('/proc/self/fd')),
          'threads': _status('Threads'),
          'py_threads': threading.active_count()}


def _mix(timeout: float) -> list[Callable[[], object]]:
  me = jax.process_index()
  x8 = np.full(2, me, np.float32)
  x1k = np.full(256, me, np.float32)
  same = np.arange(4, dtype=np.int32)
  small = {'step': 1, 'host': me}
  return [
      lambda: multihost.sync_global_devices('soak', timeout=timeout),
      lambda: multihost.broadcast_one_to_all(x8, timeout=timeout),
      lambda: multihost.process_allgather(x8, timeout=timeout),
      lambda: multihost.broadcast_one_to_all(x1k, timeout=timeout),
      lambda: multihost.process_allgather(x1k, timeout=timeout),
      lambda: multihost.allgather_object(small, timeout=timeout),
      lambda: multihost.broadcast_object(small, timeout=timeout),
      lambda: multihost.assert_equal(same, 'soak', timeout=timeout),
  ]


def run(calls: int, *, timeout: float = 120.0,
        say: Callable[..., None] = print) -> list[dict]:
  """Runs `calls` mixed collectives; returns one row per report point.

  Collective: every process must call this, in the same order. Each row:
  `calls`, `seconds`, and per process (`processes`, in order) its sample.
  The samples' own collective (one all-gather per point) is not counted.
  """
  mix = _mix(timeout)
  marks = sorted({max(1, round(calls * p)) for p in POINTS})
  rows = []
  done = 0
  start = time.perf_counter()
  for mark in marks:
    while done < mark:
      mix[done % len(mix)]()
      done += 1
    samples = multihost.allgather_object(sample(), timeout=timeout)
    rows.append({'kind': 'soak', 'calls': done,
                 'seconds': time.perf_counter() - start,
                 'processes': samples})
    say(f'soak: {done} calls, {time.perf_counter() - start:.0f} s, RSS MiB '
        f'{[round(s["rss"] / 2**20, 1) for s in samples]}, fds '
        f'{[s["fds"] for s in samples]}, threads '
        f'{[s["threads"] for s in samples]}')
  return rows


def _base(rows: list[dict]) -> dict:
  """The row at 10% of the calls (the growth target's start)."""
  want = max(1, round(rows[-1]['calls'] * 0.1))
  return min(rows, key=lambda r: abs(r['calls'] - want))


def render(rows: list[dict]) -> str:
  """Per report point: every process's RSS (MiB), fds and OS threads."""
  count = len(rows[0]['processes'])
  head = ' | '.join(f'p{p} RSS MiB | p{p} fds | p{p} threads (Python)'
                    for p in range(count))
  lines = [f'| calls | seconds | {head} |',
           '|---|---|' + '---|' * (3 * count)]
  for r in rows:
    cells = ' | '.join(f'{s["rss"] / 2**20:.1f} | {s["fds"]} | '
                       f'{s["threads"]} ({s.get("py_threads", "?")})'
                       for s in r['processes'])
    lines.append(f'| {r["calls"]} | {r["seconds"]:.0f} | {cells} |')
  return '\n'.join(lines)


def targets(rows: list[dict]) -> list[tuple[str, str, str]]:
  """The soak's "Done when" rows: RSS growth per process, fds and threads.

  Threads are the OS's (Python's and the runtime's: process 0's gRPC
  server sizes its event-engine pool to the load), with Python's apart.
  """
  base, last = _base(rows), rows[-1]
  span = f'calls {base["calls"]} -> {last["calls"]}'
  out = []
  growth = [e['rss'] - b['rss'] for b, e in zip(
      base['processes'], last['processes'], strict=True)]
  out.append((
      f'soak: every process\'s RSS grows <= 4 MiB ({span})',
      ', '.join(f'p{p} {g / 2**20:+.1f} MiB' for p, g in enumerate(growth)),
      'met' if max(growth) <= RSS_GROWTH_LIMIT else 'missed'))
  for key in ('fds', 'threads', 'py_threads'):
    pairs = [(b.get(key), e.get(key)) for b, e in zip(
        base['processes'], last['processes'], strict=True)]
    name = {'py_threads': 'Python threads'}.get(key, key)
    out.append((f'soak: {name} constant ({span})',
                ', '.join(f'p{p} {a} -> {b}' for p, (a, b) in
                          enumerate(pairs)),
                'met' if all(a == b for a, b in pairs) else 'missed'))
  return out
