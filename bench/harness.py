"""Timing: barriers, interleaved calls, medians of the slowest process, peak memory.

Every function here that meets other processes is a collective: every
process must call it, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import gc
import itertools
import resource
import statistics
import time
from typing import Any

import jax
import numpy as np

import multihost
from multihost import lowlevel  # The raw coordination-service barrier.

SMALL_BYTES = 1 << 20  # Payloads up to this take Settings.small_repeats.


def _shorten(message: object, limit: int) -> str:
  """`message` on one line, cut to `limit` characters."""
  text = ' '.join(str(message).split())
  return text if len(text) <= limit else text[:limit] + '...'


@dataclasses.dataclass(frozen=True)
class Settings:
  """How every case is timed (from bin/bench.py's flags)."""
  repeats: int = 11  # Timed calls of each implementation per case.
  # Timed calls of each for cases of one leaf (or none) of at most
  # SMALL_BYTES: calls of about a millisecond, whose medians of 11 samples
  # moved by +-40% between runs on 2 cores.
  small_repeats: int = 51
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


def usage_per_call(fn: Callable[[], Any], calls: int,
                   settings: Settings) -> tuple[float, float, float]:
  """(wall ms, CPU ms, voluntary context switches) per call of `calls` back-to-back calls of `fn` on this process, after a barrier.

  CPU is `time.process_time` (every thread of the process); the switches
  are its sleeps (waits for a peer).
  """
  barrier(settings)
  switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
  cpu, wall = time.process_time(), time.perf_counter()
  for _ in range(calls):
    fn()
  wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches
  return wall / calls * 1e3, cpu / calls * 1e3, switches / calls


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
  return timed_with_output(fn, settings)[0]


def timed_with_output(fn: Callable[[], Any],
                      settings: Settings) -> tuple[float, Any]:
  """(seconds, output) of one call of `fn` on this process, after a barrier."""
  barrier(settings)
  t = time.perf_counter()
  out = fn()
  elapsed = time.perf_counter() - t
  return elapsed, out


def touch(nbytes: int) -> None:
  """Writes `nbytes` of fresh memory on this process, then frees it.

  This VM's kernel reports freed memory to the hypervisor
  (page_reporting), which takes it back: the next touch of such memory
  costs a host fault per page. Measured at P=4: a first 64 MiB all-gather
  (256 MiB of output per process) took 0.6-0.9 s on never-touched memory
  and 0.16-0.25 s right after memory of that size was touched and freed.
  Touching before each first call puts neither implementation first in
  line for that cost, so first calls measure the implementations (compiles,
  connections, caches), not which one ran first.
  """
  if nbytes > 0:
    np.ones(nbytes, np.uint8)


def _touch_bytes(case: Case) -> int:
  """Memory a case's call may newly touch: (processes + 2) x its payload, at most 1 GiB."""
  return min(1 << 30, case.payload_bytes * (jax.process_count() + 2))


def _batched(fn: Callable[[], Any], calls: int) -> Callable[[], Any]:
  if calls == 1:
    return fn

  def run():
    for _ in range(calls - 1):
      fn()
    return fn()
  return run


def _leaf_value(x):
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key):
    return ('key', str(jax.random.key_impl(x)),
            np.asarray(jax.random.key_data(x)))
  if isinstance(x, (jax.Array, np.ndarray, np.generic)):
    return np.asarray(x)
  return x


def difference(ours: Any, theirs: Any) -> str:
  """'' if the two outputs are equal (structure, shapes, dtypes, values)."""
  a_leaves, a_def = jax.tree.flatten(ours)
  b_leaves, b_def = jax.tree.flatten(theirs)
  if a_def != b_def:
    return f'tree {a_def} != {b_def}'
  for i, (a, b) in enumerate(zip(a_leaves, b_leaves, strict=True)):
    a, b = _leaf_value(a), _leaf_value(b)
    if isinstance(a, tuple) and isinstance(b, tuple):
      if a[:2] != b[:2] or not np.array_equal(a[2], b[2]):
        return f'leaf {i}: keys differ'
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
      a, b = np.asarray(a), np.asarray(b)
      if a.shape != b.shape or a.dtype != b.dtype:
        return (f'leaf {i}: {a.dtype}{list(a.shape)} != '
                f'{b.dtype}{list(b.shape)}')
      if not np.array_equal(a, b):
        return f'leaf {i}: values differ'
    elif type(a) is not type(b) or a != b:
      return f'leaf {i}: {_shorten(a, 40)} != {_shorten(b, 40)}'
  return ''


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
  # Ours == JAX's output: True, False (the run fails), None (not compared).
  outputs_equal: bool | None = None
  # The slowest process's time per timed iteration (medians are of these).
  ours_times_ms: list[float] | None = None
  jax_times_ms: list[float] | None = None

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
  jax: Callable[[], Any] | None  # None: nothing to compare with (timed alone)
  # What ours must return when there is no `jax` (e.g. the error's name).
  expected: Any = None
  repeats: int | None = None  # Overrides Settings.repeats (slow cases).
  # Calls per timed sample, back to back after one barrier (the time is per
  # call). For local operations (no communication) whose cost is near the
  # barrier's aftermath; collectives keep 1 (a barrier before each call).
  calls: int = 1


def repeats(case: Case, settings: Settings) -> int:
  """Timed calls of each implementation of `case`."""
  if case.repeats:
    return case.repeats
  if case.leaves <= 1 and case.payload_bytes <= SMALL_BYTES:
    return max(settings.repeats, settings.small_repeats)
  return settings.repeats


def run_case(case: Case, index: int, settings: Settings) -> Row:
  """Times `case`; every process returns the row.

  Collective: every process must call this, in the same order.

  The first call of each implementation (ours first on even `index`, JAX
  first on odd), `settings.warmup` untimed calls of each, then
  `repeats(case, settings)` timed calls alternating ours, jax, ... Each
  timed call (or batch of `case.calls` calls, timed per call) starts after
  a barrier; each iteration counts the slowest process; the row holds
  medians, and the peak memory increase of one more call of each. Before
  each first call, every process touches and frees as much memory as the
  case may need (`touch`).
  """
  row = Row(case.op, case.payload_bytes, case.leaves, payload=case.payload)
  impls = {'ours': case.ours}
  if case.jax is not None:
    impls['jax'] = case.jax
  order = ['ours', 'jax'] if index % 2 == 0 else ['jax', 'ours']
  order = [n for n in order if n in impls]
  first: dict[str, float | None] = {'jax': None}
  outputs: dict[str, Any] = {}
  failed: dict[str, str] = {}
  for name in order:
    touch(_touch_bytes(case))
    try:
      first[name], outputs[name] = timed_with_output(impls[name], settings)
    except Exception as e:  # pylint: disable=broad-except
      # E.g. JAX's assert_equal on a global array. Every process fails the
      # same way after the collective, so the run continues; the name goes
      # into the table.
      failed[name] = f'{type(e).__name__}: {_shorten(e, 120)}'
      first[name] = None
  # Ours must give JAX's output (or the expected one); any process seeing a
  # difference marks the row, and bin/bench.py then fails the run.
  if 'ours' in failed:
    mine = failed['ours']
  elif case.jax is None:
    mine = difference(outputs['ours'], case.expected)
  elif 'jax' in outputs:
    mine = difference(outputs['ours'], outputs['jax'])
  else:
    mine = None  # JAX failed: nothing to compare with.
  outputs.clear()
  verdicts = multihost.allgather_object(mine, timeout=settings.timeout)
  if all(v is None for v in verdicts):
    row.outputs_equal = None
  else:
    bad = [f'process {p}: {v}' for p, v in enumerate(verdicts) if v]
    row.outputs_equal = not bad
    if bad:
      row.note = 'OUTPUT MISMATCH (' + '; '.join(bad) + ')'
  live = [n for n in ('ours', 'jax') if n in impls and n not in failed]
  for _ in range(settings.warmup):
    for name in live:
      impls[name]()
  times: dict[str, list[float]] = {n: [] for n in live}
  samples = {n: _batched(impls[n], case.calls) for n in live}
  for _ in range(repeats(case, settings)):
    for name in live:
      times[name].append(timed(samples[name], settings) / case.calls)
  for name in ('ours', 'jax'):
    first_ms = ms(slowest_one(first[name], settings))
    per_iteration = ([ms(t) for t in slowest(times[name], settings)]
                     if name in live else None)
    median = statistics.median(per_iteration) if per_iteration else None
    measure = settings.memory and name in live
    peak = peak_increase(impls[name], settings) if measure else None
    peak = slowest_one(peak, settings)
    setattr(row, f'{name}_first_ms', first_ms)
    setattr(row, f'{name}_ms', median)
    setattr(row, f'{name}_times_ms', per_iteration)
    setattr(row, f'{name}_peak_bytes', peak)
  notes = [row.note] if row.note else []
  notes += [f'{n} n/a ({m})' for n, m in failed.items()
            if n != 'ours' or row.outputs_equal is not False]
  if case.jax is None and not failed:
    notes.append('ours alone (JAX has no equivalent)')
  row.note = '; '.join(notes)
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


def torch_group(settings: Settings):
  """torch.distributed (gloo) set up on every process, or None unless every process has torch.

  Collective: every process must call this, in the same order.
  """
  try:
    import torch.distributed as dist  # pylint: disable=import-outside-toplevel
  except ImportError:
    dist = None
  have = multihost.allgather_object(dist is not None,
                                    timeout=settings.timeout)
  if not all(have):
    return None
  port = None
  if jax.process_index() == 0:
    from multihost import launch  # pylint: disable=import-outside-toplevel
    port = launch.find_free_port()
  port = multihost.broadcast_object(port, timeout=settings.timeout)
  dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}',
                          rank=jax.process_index(),
                          world_size=jax.process_count())
  return dist
