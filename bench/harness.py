"""Timing: barriers, interleaved calls, medians of the slowest process, peak memory.

Every function here that meets other processes is a collective: every
process must call it, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import gc
import itertools
import statistics
import time
from typing import Any

import jax

import multihost
from multihost import lowlevel  # The raw coordination-service barrier.


@dataclasses.dataclass(frozen=True)
class Settings:
  """How every case is timed (from bin/bench.py's flags)."""
  repeats: int = 11  # Timed calls of each implementation per case.
  warmup: int = 2  # Untimed calls of each, after the first.
  memory: bool = True  # Measure the peak memory increase per call.
  timeout: float = 120.0  # Seconds, for every collective.


def format_size(n: int) -> str:
  """67108864 -> '64 MiB'; 8 -> '8 B'."""
  for unit, scale in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
    if n >= scale and n % scale == 0:
      return f'{n // scale} {unit}'
  return f'{n} B'


# -- measuring -----------------------------------------------------------------

_barrier_ids = itertools.count()


def barrier(settings: Settings) -> None:
  """All processes meet (coordination service; a few tenths of a ms)."""
  if jax.process_count() > 1:
    lowlevel.wait_at_barrier(f'multihost-bench/{next(_barrier_ids)}',
                             settings.timeout)


def _status(field: str) -> int | None:
  try:
    with open('/proc/self/status') as f:
      for line in f:
        if line.startswith(field + ':'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def _reset_peak() -> bool:
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
    return True
  except OSError:
    return False


def peak_increase(fn: Callable[[], Any], settings: Settings) -> int | None:
  """Bytes by which one call of `fn` raises the peak RSS, output included."""
  gc.collect()
  barrier(settings)
  ok = _reset_peak()
  before = _status('VmRSS')
  out = fn()
  peak = _status('VmHWM')
  del out
  if not ok or before is None or peak is None:
    return None
  return max(0, peak - before)


def timed(fn: Callable[[], Any], settings: Settings) -> float:
  """Seconds one call of `fn` takes on this process, after a barrier."""
  barrier(settings)
  t = time.perf_counter()
  out = fn()
  elapsed = time.perf_counter() - t
  del out
  return elapsed


def slowest(values: list[float], settings: Settings) -> list[float]:
  """Per iteration, the largest of every process's `values`."""
  per_process = multihost.allgather_object(values, timeout=settings.timeout)
  return [max(v) for v in zip(*per_process, strict=True)]


def slowest_one(value, settings: Settings):
  """The largest of every process's `value` (None if any is None)."""
  values = multihost.allgather_object(value, timeout=settings.timeout)
  return None if any(v is None for v in values) else max(values)


def ms(seconds: float | None) -> float | None:
  return None if seconds is None else seconds * 1e3


@dataclasses.dataclass
class Row:
  """One table row; `to_json` gives the --json object."""
  op: str
  payload_bytes: int
  leaves: int
  kind: str = 'compare'  # 'compare', 'reference' or 'recovery'
  ours_ms: float | None = None
  jax_ms: float | None = None
  ours_first_ms: float | None = None
  jax_first_ms: float | None = None
  ours_peak_bytes: int | None = None
  jax_peak_bytes: int | None = None
  ref_ms: float | None = None
  ref_first_ms: float | None = None
  payload: str = ''
  note: str = ''

  @property
  def ratio(self) -> float | None:
    if self.ours_ms is None or not self.jax_ms:
      return None
    return self.ours_ms / self.jax_ms

  def to_json(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out['processes'] = jax.process_count()
    out['devices_per_process'] = jax.local_device_count()
    out['ratio'] = self.ratio
    return out


@dataclasses.dataclass
class Case:
  """One comparison: our implementation and JAX's of one op on one input."""
  op: str
  payload: str
  payload_bytes: int
  leaves: int
  ours: Callable[[], Any]
  jax: Callable[[], Any]


def run_case(case: Case, index: int, settings: Settings) -> Row:
  """Times `case`; every process returns the row.

  Collective: every process must call this, in the same order.

  The first call of each implementation (ours first on even `index`, JAX
  first on odd), `settings.warmup` untimed calls of each, then
  `settings.repeats` timed calls alternating ours, jax, ... Each timed call
  starts after a barrier; each iteration counts the slowest process; the
  row holds medians, and the peak memory increase of one more call of each.
  """
  row = Row(case.op, case.payload_bytes, case.leaves, payload=case.payload)
  impls = {'ours': case.ours, 'jax': case.jax}
  order = ['ours', 'jax'] if index % 2 == 0 else ['jax', 'ours']
  first: dict[str, float | None] = {}
  failed: dict[str, str] = {}
  for name in order:
    try:
      first[name] = timed(impls[name], settings)
    except Exception as e:  # pylint: disable=broad-except
      # E.g. JAX's assert_equal on a global array. Every process fails the
      # same way after the collective, so the run continues; the name goes
      # into the table.
      failed[name] = f'{type(e).__name__}: {lowlevel.shorten(e, 120)}'
      first[name] = None
  live = [n for n in ('ours', 'jax') if n not in failed]
  for _ in range(settings.warmup):
    for name in live:
      impls[name]()
  times: dict[str, list[float]] = {n: [] for n in live}
  for _ in range(settings.repeats):
    for name in live:
      times[name].append(timed(impls[name], settings))
  for name in ('ours', 'jax'):
    first_ms = ms(slowest_one(first[name], settings))
    median = (ms(statistics.median(slowest(times[name], settings)))
              if name in live else None)
    measure = settings.memory and name in live
    peak = peak_increase(impls[name], settings) if measure else None
    peak = slowest_one(peak, settings)
    setattr(row, f'{name}_first_ms', first_ms)
    setattr(row, f'{name}_ms', median)
    setattr(row, f'{name}_peak_bytes', peak)
  if failed:
    row.note = '; '.join(f'{n} n/a ({m})' for n, m in failed.items())
  return row


def time_reference(fn: Callable[[], Any], repeats: int,
                   settings: Settings) -> tuple[float, float]:
  """(first, median) ms of `fn`, slowest process per call.

  Collective: every process must call this, in the same order.
  """
  first = ms(slowest_one(timed(fn, settings), settings))
  for _ in range(settings.warmup):
    fn()
  median = ms(statistics.median(
      slowest([timed(fn, settings) for _ in range(repeats)], settings)))
  return first, median
