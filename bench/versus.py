"""Ours against torch.distributed gloo and a raw TCP stream, in interleaved rounds of the same run.

Every round times each case once per side: after a barrier, `calls`
back-to-back calls, per call; the slowest process counts. The side that
goes first alternates by round. Tables give the medians over rounds, and
`targets` marks the targets (`TARGETS`) met or missed.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np

from bench import harness
from bench import report
from bench.harness import Settings
from bench.reference import BusyCores
from bench.reference import RawStream
from bench.reference import RoundTrip
import multihost

MiB = 1 << 20


@dataclasses.dataclass
class Case:
  """One collective on both sides (torch None: ours alone; ours None: torch's alone, `run`'s side='torch')."""
  name: str
  nbytes: int
  calls: int  # back-to-back calls per round and side
  ours: Callable[[], Any] | None
  torch: Callable[[], Any] | None = None


@dataclasses.dataclass
class Result:
  """A case's per-round times (ms per call, slowest process)."""
  name: str
  nbytes: int
  ours: list[float]
  torch: list[float] | None

  @property
  def ours_ms(self) -> float | None:
    return statistics.median(self.ours) if self.ours else None

  @property
  def torch_ms(self) -> float | None:
    return statistics.median(self.torch) if self.torch else None

  def to_json(self) -> dict:
    return {'kind': 'versus', 'op': self.name, 'payload_bytes': self.nbytes,
            'processes': jax.process_count(), 'ours_ms': self.ours_ms,
            'torch_ms': self.torch_ms, 'ours_times_ms': self.ours,
            'torch_times_ms': self.torch}


SIZES = (8, MiB, 64 * MiB)
BUSY = ' (CPU busy)'
# Ours with $MULTIHOST_LOCAL_LINKS=0: every link over TCP, as between
# processes on different hosts (`bench/scaling.py` runs it too).
OVER_TCP = ' (links over TCP)'
# Each side alone in launches of its own that alternate (`bench.scaling`).
ALONE = ' (each side alone)'
# `run`'s side: both in the same processes (interleaved rounds), or one
# alone (torch not even imported for 'ours'); `bench.scaling` alternates
# launches of each alone.
SIDES = ('both', 'ours', 'torch')


# The case families `run` may be limited to (`ops`): every case's name
# starts with its family's, but for 'objects' (the object collectives) and
# 'references' (the raw streams and round trips, ours alone).
OPS = ('barrier', 'broadcast', 'all-gather', 'exchange', 'objects',
       'references')


def build_cases(dist, refs: list, sizes=SIZES, ops=OPS) -> list[Case]:
  """The compared cases of the families `ops`, ours and torch's (with `dist`, else None) on the same payloads."""
  me, count = jax.process_index(), jax.process_count()
  cases = ([Case('barrier', 0, 20, lambda: multihost.sync_global_devices('b'),
                 dist and dist.barrier)] if 'barrier' in ops else [])
  for n in sizes:
    calls = 20 if n <= MiB else 2
    x = np.full(max(1, n // 4), me, np.float32)
    bcast = gather = None
    if dist is not None:
      import torch  # pylint: disable=import-outside-toplevel,g-import-not-at-top
      t = torch.full((max(1, n // 4),), float(me))
      outs = [torch.empty_like(t) for _ in range(count)]
      bcast = lambda t=t: dist.broadcast(t, 0)  # noqa: E731
      gather = lambda t=t, outs=outs: dist.all_gather(outs, t)  # noqa: E731
    if 'broadcast' in ops:
      cases.append(Case(
          f'broadcast {harness.format_size(n)}', n, calls,
          lambda x=x: multihost.broadcast_one_to_all(x), bcast))
    if 'all-gather' in ops:
      cases.append(Case(
          f'all-gather {harness.format_size(n)}', n, calls,
          lambda x=x: multihost.process_allgather(x), gather))
    if 'exchange' in ops:
      cases.append(_exchange_case(dist, n, calls))
  if 'objects' not in ops:
    return cases + _references(refs)
  small = {'step': 7, 'loss': 0.25, 'host': f'h{me}'}
  gathered = [None] * count
  cases.append(Case(
      'all-gather of a small object', 64, 20,
      lambda: multihost.allgather_object(small),
      dist and (lambda: dist.all_gather_object(gathered, small))))
  kib = bytes(1024)
  cases.append(Case(
      'broadcast of a 1 KiB object', 1024, 20,
      lambda: multihost.broadcast_object(kib),
      dist and (lambda: dist.broadcast_object_list([kib], 0))))
  return cases + _references(refs)


def _exchange_case(dist, n: int, calls: int) -> Case:
  """A ring exchange of `n` bytes: each process sends to the next, receives from the previous (torch: `batch_isend_irecv`)."""
  me, count = jax.process_index(), jax.process_count()
  nxt, prev = (me + 1) % count, (me - 1) % count
  x = np.full(max(1, n // 4), me, np.float32)
  ours = lambda: multihost.exchange({nxt: x}, recv_from=[prev])  # noqa: E731
  theirs = None
  if dist is not None:
    import torch  # pylint: disable=import-outside-toplevel,g-import-not-at-top
    t, into = torch.from_numpy(x), torch.empty(max(1, n // 4))

    def theirs():
      ops = [dist.P2POp(dist.isend, t, nxt), dist.P2POp(dist.irecv, into, prev)]
      for request in dist.batch_isend_irecv(ops):
        request.wait()
  return Case(f'exchange (ring) {harness.format_size(n)}', n, calls, ours,
              theirs)


def _references(refs: list) -> list[Case]:
  """The reference cases (ours alone): raw streams and round trips (`RawStream`, `RoundTrip`)."""
  return [Case(ref.name, ref.nbytes, ref.calls, ref) for ref in refs]


def _make_references(settings: Settings, raw_bytes: int) -> list:
  """The raw streams and round trips between processes 0 and 1: over loopback TCP, and (Linux) over a local socket as our links on one host use."""
  kinds = (False, True) if sys.platform.startswith('linux') else (False,)
  return ([RawStream(raw_bytes, settings, local) for local in kinds]
          + [RoundTrip(settings, local) for local in kinds])


def _per_call(fn: Callable[[], Any], calls: int, settings: Settings) -> float:
  harness.barrier(settings)
  t = time.perf_counter()
  for _ in range(calls):
    fn()
  return (time.perf_counter() - t) / calls * 1e3


def run(rounds: int, settings: Settings, *, raw_bytes: int = 64 * MiB,
        sizes=SIZES, busy: bool = False,
        busy_placement: str = 'every_process', side: str = 'both',
        ops=OPS, say: Callable[..., None] = print) -> list[Result]:
  """Times every case in `rounds` interleaved rounds; every process returns the results.

  Collective: every process must call this, in the same order. With
  `busy`, one spinning process per core runs beside both sides while they
  are timed (a training host's cores are rarely idle; `busy_placement`:
  whose children they are, see `BusyCores`), and every case's name ends in
  ' (CPU busy)'. `side` (`SIDES`): 'ours' times ours alone (torch is not
  imported; the raw streams and round trips too), 'torch' torch gloo's
  alone (a Result's other side is empty). `ops`: the case families timed
  (`OPS`).
  """
  if side not in SIDES:
    raise ValueError(f'side={side!r}: choose one of {SIDES}.')
  unknown = sorted(set(ops) - set(OPS))
  if unknown:
    raise ValueError(f'versus ops: unknown {unknown}; choose from {OPS}.')
  dist = harness.torch_group(settings) if side != 'ours' else None
  if side == 'torch' and dist is None:
    raise RuntimeError('versus side=torch: torch is not importable on every '
                       'process; pip install torch==2.13.0 (CPU) to compare.')
  several = jax.process_count() > 1
  refs = (_make_references(settings, raw_bytes)
          if several and side != 'torch' and 'references' in ops else [])
  spinners = None
  try:
    cases = build_cases(dist, refs, sizes, ops)
    if side == 'torch':
      cases = [dataclasses.replace(c, ours=None) for c in cases if c.torch]
    for case in cases:  # Warm-up: connections, compiles, caches.
      for fn in (case.ours, case.torch):
        if fn is not None:
          fn()
          fn()
    if busy:
      spinners = BusyCores(settings, busy_placement)
    ours: dict[str, list[float]] = {c.name: [] for c in cases}
    theirs: dict[str, list[float]] = {c.name: [] for c in cases}
    for r in range(rounds):
      for case in cases:
        sides = [('ours', case.ours), ('torch', case.torch)]
        if r % 2:
          sides.reverse()
        for who, fn in sides:
          if fn is not None:
            (ours if who == 'ours' else theirs)[case.name].append(
                _per_call(fn, case.calls, settings))
      say(f'versus: round {r + 1} of {rounds} done')
    results = []
    for case in cases:
      mine = harness.slowest(ours[case.name], settings)
      other = (harness.slowest(theirs[case.name], settings)
               if case.torch is not None else None)
      results.append(Result(case.name + (BUSY if busy else ''), case.nbytes,
                            mine, other))
    return results
  finally:
    if spinners is not None:
      spinners.close()
    for ref in refs:
      ref.close()
    if dist is not None:
      dist.destroy_process_group()


def render(results: list[Result]) -> str:
  """The side-by-side table (medians of rounds, ms per call)."""
  f = _fmt
  lines = ['| case | ours ms | torch gloo ms | ours / torch | rounds |',
           '|---|---|---|---|---|']
  for r in results:
    ratio = (r.ours_ms / r.torch_ms
             if r.torch_ms and r.ours_ms is not None else None)
    lines.append(f'| {r.name} | {f(r.ours_ms)} | {f(r.torch_ms)} | '
                 f'{f(ratio, 3)} | {max(len(r.ours), len(r.torch or []))} |')
  return '\n'.join(lines)


_fmt = report.fmt


# The targets at P=2: (target, case, what it is compared with: 'torch' or
# another case of ours, the largest ratio that meets it).
TARGETS = (
    ('barrier <= torch gloo', 'barrier', 'torch', 1.0),
    ('broadcast 8 B <= torch gloo', 'broadcast 8 B', 'torch', 1.0),
    ('all-gather 8 B <= torch gloo', 'all-gather 8 B', 'torch', 1.0),
    ('broadcast 1 MiB <= torch gloo', 'broadcast 1 MiB', 'torch', 1.0),
    ('broadcast 64 MiB <= torch gloo', 'broadcast 64 MiB', 'torch', 1.0),
    ('all-gather of a small object <= torch gloo',
     'all-gather of a small object', 'torch', 1.0),
    ('broadcast of a 1 KiB object <= torch gloo',
     'broadcast of a 1 KiB object', 'torch', 1.0),
    ('all-gather 64 MiB <= 0.5x torch gloo', 'all-gather 64 MiB', 'torch',
     0.5),
    ('broadcast 64 MiB <= 1.3x a raw stream', 'broadcast 64 MiB',
     'raw TCP stream 64 MiB', 1.3),
    # A margin that any fair harness sees.
    ('broadcast 1 MiB <= 0.9x torch gloo', 'broadcast 1 MiB', 'torch', 0.9),
    ('broadcast 64 MiB <= 0.9x torch gloo', 'broadcast 64 MiB', 'torch',
     0.9),
    ('broadcast 64 MiB <= 1.1x a raw stream', 'broadcast 64 MiB',
     'raw TCP stream 64 MiB', 1.1),
    # On one host our links are local sockets: against a raw one too.
    ('broadcast 64 MiB <= 1.1x a raw local stream', 'broadcast 64 MiB',
     'raw local stream 64 MiB', 1.1),
    # The floor: one Python round trip over loopback, in the same run.
    ('barrier <= 3x one round trip', 'barrier', RoundTrip.NAME, 3.0),
    ('broadcast 8 B <= 4x one round trip', 'broadcast 8 B', RoundTrip.NAME,
     4.0),
    ('all-gather 8 B <= 4x one round trip', 'all-gather 8 B', RoundTrip.NAME,
     4.0),
    # ... and over a local socket, the floor of our links on one host.
    ('barrier <= 3x one local round trip', 'barrier', RoundTrip.LOCAL_NAME,
     3.0),
    ('broadcast 8 B <= 4x one local round trip', 'broadcast 8 B',
     RoundTrip.LOCAL_NAME, 4.0),
    ('all-gather 8 B <= 4x one local round trip', 'all-gather 8 B',
     RoundTrip.LOCAL_NAME, 4.0),
) + tuple(
    # Every link over TCP (as between hosts), in a run of its own.
    (f'{case}, links over TCP <= {limit}x torch gloo'.replace(' 1.0x', ''),
     case + OVER_TCP, 'torch', limit)
    for case, limit in (('barrier', 1.0), ('broadcast 8 B', 1.0),
                        ('all-gather 8 B', 1.0), ('broadcast 1 MiB', 0.9),
                        ('broadcast 64 MiB', 0.9))) + tuple(
    # With one spinning process per core beside both sides.
    (f'{case}, CPU busy <= torch gloo', case + BUSY, 'torch', 1.0)
    for case in ('barrier', 'broadcast 8 B', 'all-gather 8 B',
                 'broadcast 1 MiB', 'all-gather 1 MiB',
                 'all-gather of a small object',
                 'broadcast of a 1 KiB object'))


def targets(results: list[Result], soak_rows: list[dict] | None = None
            ) -> list[tuple[str, str, str]]:
  """(target, measured, 'met'/'missed'/'not measured') per "Done when" row."""
  by_name = {r.name: r for r in results}
  rows = []
  for label, case, against, limit in TARGETS:
    mine = by_name.get(case)
    other = by_name.get(against) if against != 'torch' else mine
    base = None
    if other is not None:
      base = other.torch_ms if against == 'torch' else other.ours_ms
    if mine is None or mine.ours_ms is None or base is None:
      rows.append((label, 'n/a', 'not measured'))
      continue
    ratio = mine.ours_ms / base
    rows.append((label, f'{_fmt(mine.ours_ms)} vs {_fmt(base)} ms = '
                 f'{ratio:.2f}x', 'met' if ratio <= limit else 'missed'))
  if soak_rows:
    from bench import soak  # pylint: disable=import-outside-toplevel
    rows.extend(soak.targets(soak_rows))
  else:
    rows.append(('soak: RSS +<= 4 MiB from 10k to 100k calls, fds and '
                 'threads constant', 'n/a', 'not measured'))
  return rows


def render_targets(rows: list[tuple[str, str, str]]) -> str:
  lines = ['| target (P=2) | measured (medians of interleaved rounds) | '
           'status |', '|---|---|---|']
  lines += [f'| {t} | {m} | {s} |' for t, m, s in rows]
  return '\n'.join(lines)
