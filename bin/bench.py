r"""Times multihost's collectives against jax.experimental.multihost_utils.

Run under the launcher (process 0 prints the tables):

  python -m multihost.launch --num_processes=2 --devices_per_process=1 -- \
      python bin/bench.py [--json=/tmp/bench.jsonl] [--recovery]

Method:
* Every case runs ours and JAX's implementation in the same run, on the same
  inputs (numpy arrays; broadcast: process 0's data, zeros elsewhere;
  allgather: different data per process; assert_equal: equal data).
* Before any case, one plain jitted all-gather sets up gloo's connections, so
  neither implementation's first call pays that process-wide cost.
* First call: the very first call of each implementation for that case
  (before warm-up; it includes compilation). Ours goes first on even-numbered
  cases, JAX first on odd ones.
* Then `--warmup` untimed calls of each, then `--repeats` timed calls,
  alternating ours, jax, ours, jax, ... Before every timed call all processes
  meet at a coordination-service barrier (not timed), so that the calls start
  together. Each process times its own calls; the times are gathered after
  the loop, and each iteration counts the slowest process. Tables show
  medians.
* Peak memory: after timing, one more call of each implementation with the
  kernel's peak-RSS counter reset first (writing "5" to /proc/self/clear_refs
  resets VmHWM); the increase is VmHWM after the call minus VmRSS before it,
  output included, max over processes. "n/a" when /proc does not allow it.
* Reference rows: the coordination-service barrier, a plain jitted all-gather
  and psum of a prebuilt global array, loopback TCP between processes 0 and 1,
  and torch.distributed (gloo) when `import torch` works.
* `--recovery`: checkpoint save + restore + verification of a transition
  state of 2 x --width float32 weights with `recovery.Checkpoints`, against
  plain `orbax.checkpoint.StandardCheckpointer` save + restore of the same
  tree, alternating, on a folder shared by all processes.

`--json=FILE` writes JSON Lines: one object per table row, with the keys `op`,
`payload_bytes`, `leaves`, `processes`, `ours_ms`, `jax_ms`, `ratio`,
`ours_first_ms`, `jax_first_ms` (plus `kind`, peak memory and notes).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from absl import app
from absl import flags
from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

import multihost
from multihost import lowlevel  # The raw coordination-service barrier.

_SIZES = flags.DEFINE_list(
    'sizes', ['8', '1KiB', '1MiB', '64MiB'],
    'Single-leaf payload sizes per process (B, KiB, MiB).')
_LEAVES = flags.DEFINE_integer(
    'leaves', 100, 'Leaves of the many-leaf tree case (8 B each); 0: skip.',
    lower_bound=0)
_GLOBAL_SIZES = flags.DEFINE_list(
    'global_sizes', ['1MiB', '64MiB'],
    'Total sizes of the global sharded array cases.')
_OPS = flags.DEFINE_list(
    'ops', ['sync_global_devices', 'broadcast_one_to_all', 'process_allgather',
            'assert_equal', 'global', 'reference'],
    'What to run: sync_global_devices, broadcast_one_to_all, '
    'process_allgather, assert_equal, global (sharded global array cases), '
    'reference (reference rows). Empty: none (e.g. only --recovery).')
_REPEATS = flags.DEFINE_integer('repeats', 11, 'Timed calls of each '
                                'implementation per case.', lower_bound=1)
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed calls of each '
                               'implementation per case, after the first.',
                               lower_bound=0)
_MEMORY = flags.DEFINE_boolean('memory', True,
                               'Measure the peak memory increase per call.')
_JSON = flags.DEFINE_string('json', '', 'Write the rows to this file as JSON '
                            'Lines (process 0).')
_RECOVERY = flags.DEFINE_boolean(
    'recovery', False, 'Also run the recovery benchmark (checkpoint save + '
    'restore + verification vs plain Orbax StandardCheckpointer).')
_WIDTH = flags.DEFINE_integer(
    'width', 32 * 2**20,
    'Recovery benchmark: float32 weights per leaf of the state (two leaves, '
    'weights and momentum); the default makes a 256 MiB state.', lower_bound=1)
_RECOVERY_REPEATS = flags.DEFINE_integer(
    'recovery_repeats', 3, 'Recovery benchmark: timed rounds of each (after '
    'one untimed round of each).', lower_bound=1)
_RECOVERY_SHARDING = flags.DEFINE_enum(
    'recovery_sharding', 'replicated', ['replicated', 'sharded'],
    'Recovery benchmark: the state leaves are replicated on every device (as '
    'in bin/train.py) or sharded over all devices.')
_RECOVERY_DIR = flags.DEFINE_string(
    'recovery_dir', '', 'Recovery benchmark: parent folder of the checkpoint '
    'folders, shared by all processes (default: the temp folder).')
_TCP_BYTES = flags.DEFINE_string('tcp_bytes', '64MiB',
                                 'Loopback TCP reference: bytes per transfer.')
_QUICK = flags.DEFINE_boolean(
    'quick', False, 'Tiny smoke run: sizes 8 and 1KiB, 10 leaves, 3 repeats, '
    '1 warm-up, a 1 MiB global array, 1 MiB TCP, recovery width 4096.')
_TIMEOUT = flags.DEFINE_float('timeout', 120.0,
                              'Timeout of every collective, in seconds.')

_UNITS = {'': 1, 'b': 1, 'kib': 2**10, 'mib': 2**20, 'gib': 2**30,
          'kb': 10**3, 'mb': 10**6, 'gb': 10**9}


def parse_size(text: str) -> int:
  """'64MiB' -> 67108864; '8' -> 8."""
  s = text.strip().lower()
  digits = s.rstrip('abcdefghijklmnopqrstuvwxyz')
  unit = s[len(digits):]
  if not digits or unit not in _UNITS:
    raise app.UsageError(
        f'Cannot read the size {text!r}; write e.g. 8, 1KiB, 64MiB.')
  return int(float(digits) * _UNITS[unit])


def format_size(n: int) -> str:
  for unit, scale in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
    if n >= scale and n % scale == 0:
      return f'{n // scale} {unit}'
  return f'{n} B'


# -- measuring -----------------------------------------------------------------

_barrier_ids = iter(range(10**9))


def barrier() -> None:
  """All processes meet (coordination service; a few tenths of a ms)."""
  if jax.process_count() > 1:
    lowlevel.wait_at_barrier(f'multihost-bench/{next(_barrier_ids)}',
                                  _TIMEOUT.value)


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


def peak_increase(fn: Callable[[], Any]) -> int | None:
  """Bytes by which one call of `fn` raises the peak RSS, output included."""
  gc.collect()
  barrier()
  ok = _reset_peak()
  before = _status('VmRSS')
  out = fn()
  peak = _status('VmHWM')
  del out
  if not ok or before is None or peak is None:
    return None
  return max(0, peak - before)


def timed(fn: Callable[[], Any]) -> float:
  """Seconds one call of `fn` takes on this process, after a barrier."""
  barrier()
  t = time.perf_counter()
  out = fn()
  elapsed = time.perf_counter() - t
  del out
  return elapsed


def slowest(values: list[float]) -> list[float]:
  """Per iteration, the largest of every process's `values`."""
  per_process = multihost.allgather_object(values, timeout=_TIMEOUT.value)
  return [max(v) for v in zip(*per_process, strict=True)]


def slowest_one(value):
  """The largest of every process's `value` (None if any is None)."""
  values = multihost.allgather_object(value, timeout=_TIMEOUT.value)
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


def run_case(case: Case, index: int) -> Row:
  """Times `case` (see the module docstring); every process returns the row."""
  row = Row(case.op, case.payload_bytes, case.leaves, payload=case.payload)
  impls = {'ours': case.ours, 'jax': case.jax}
  order = ['ours', 'jax'] if index % 2 == 0 else ['jax', 'ours']
  first: dict[str, float | None] = {}
  failed: dict[str, str] = {}
  for name in order:
    try:
      first[name] = timed(impls[name])
    except Exception as e:  # pylint: disable=broad-except
      # E.g. JAX's assert_equal on a global array. Every process fails the
      # same way after the collective, so the run continues; the name goes
      # into the table.
      failed[name] = f'{type(e).__name__}: {" ".join(str(e).split())[:120]}'
      first[name] = None
  live = [n for n in ('ours', 'jax') if n not in failed]
  for _ in range(_WARMUP.value):
    for name in live:
      impls[name]()
  times: dict[str, list[float]] = {n: [] for n in live}
  for _ in range(_REPEATS.value):
    for name in live:
      times[name].append(timed(impls[name]))
  for name in ('ours', 'jax'):
    first_ms = ms(slowest_one(first[name]))
    median = (ms(statistics.median(slowest(times[name])))
              if name in live else None)
    measure = _MEMORY.value and name in live
    peak = peak_increase(impls[name]) if measure else None
    peak = slowest_one(peak)
    setattr(row, f'{name}_first_ms', first_ms)
    setattr(row, f'{name}_ms', median)
    setattr(row, f'{name}_peak_bytes', peak)
  if failed:
    row.note = '; '.join(f'{n} n/a ({m})' for n, m in failed.items())
  return row


def time_reference(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
  """(first, median) ms of `fn`, slowest process per call."""
  first = ms(slowest_one(timed(fn)))
  for _ in range(_WARMUP.value):
    fn()
  median = ms(statistics.median(slowest([timed(fn) for _ in range(repeats)])))
  return first, median


# -- inputs --------------------------------------------------------------------


def _data(nbytes: int, seed: int) -> np.ndarray:
  n = max(1, nbytes // 4)
  return np.random.default_rng(seed).random(n, dtype=np.float32)


def _tree(leaves: int, seed: int) -> dict[str, np.ndarray]:
  # int32 leaves: not the float32 shapes of the single-leaf cases, so that
  # those cases' first calls compile their own programs.
  rng = np.random.default_rng(seed)
  return {f'leaf{i:03d}': rng.integers(0, 2**31 - 1, 2, dtype=np.int32)
          for i in range(leaves)}


def _process_mesh() -> jax.sharding.Mesh:
  """All devices, (processes, local devices), as JAX's multihost_utils uses."""
  devices = np.array(jax.devices()).reshape(jax.process_count(),
                                            jax.local_device_count())
  return jax.sharding.Mesh(devices, ('processes', 'local'))


def _global_array(nbytes: int, seed: int) -> jax.Array:
  """A float32 array of `nbytes` sharded over every device of every process."""
  mesh = _process_mesh()
  n = max(1, nbytes // 4)
  n -= n % mesh.size
  n = max(n, mesh.size)
  sharding = jax.sharding.NamedSharding(mesh, jax.P(('processes', 'local')))
  full = np.random.default_rng(seed).random(n, dtype=np.float32)
  return jax.make_array_from_callback((n,), sharding, lambda i: full[i])


def _sized_input(op: str, nbytes: int) -> np.ndarray:
  pid = jax.process_index()
  if op == 'broadcast_one_to_all':
    x = _data(nbytes, 1)
    return x if pid == 0 else np.zeros_like(x)
  if op == 'process_allgather':
    return _data(nbytes, 100 + pid)
  return _data(nbytes, 2)  # assert_equal: the same everywhere.


def _tree_input(op: str, leaves: int) -> dict[str, np.ndarray]:
  pid = jax.process_index()
  if op == 'broadcast_one_to_all':
    t = _tree(leaves, 1)
    return t if pid == 0 else jax.tree.map(np.zeros_like, t)
  if op == 'process_allgather':
    return _tree(leaves, 100 + pid)
  return _tree(leaves, 2)


_OURS = {'broadcast_one_to_all': multihost.broadcast_one_to_all,
         'process_allgather': multihost.process_allgather,
         'assert_equal': multihost.assert_equal}
_THEIRS = {'broadcast_one_to_all': multihost_utils.broadcast_one_to_all,
           'process_allgather': multihost_utils.process_allgather,
           'assert_equal': multihost_utils.assert_equal}


def build_cases(ops: list[str], sizes: list[int], leaves: int,
                global_sizes: list[int]) -> list[Case]:
  """The comparison cases, in run order."""
  timeout = _TIMEOUT.value
  cases = []
  if 'sync_global_devices' in ops:
    cases.append(Case(
        'sync_global_devices', '–', 0, 0,
        lambda: multihost.sync_global_devices('bench', timeout=timeout),
        lambda: multihost_utils.sync_global_devices('bench')))
  for op in ('broadcast_one_to_all', 'process_allgather', 'assert_equal'):
    if op not in ops:
      continue
    ours, theirs = _OURS[op], _THEIRS[op]
    if leaves:
      tree = _tree_input(op, leaves)
      cases.append(Case(
          op, f'{leaves} leaves × 8 B', 8 * leaves, leaves,
          lambda t=tree, f=ours: f(t, timeout=timeout),
          lambda t=tree, f=theirs: f(t)))
    for n in sizes:
      x = _sized_input(op, n)
      cases.append(Case(
          op, format_size(x.nbytes), x.nbytes, 1,
          lambda x=x, f=ours: f(x, timeout=timeout),
          lambda x=x, f=theirs: f(x)))
  if 'global' in ops:
    for n in global_sizes:
      g = _global_array(n, 3)
      label = f'global {format_size(g.nbytes)}, sharded'
      cases.append(Case(
          'process_allgather(tiled)', label, g.nbytes, 1,
          lambda g=g: multihost.process_allgather(g, tiled=True,
                                                  timeout=timeout),
          lambda g=g: multihost_utils.process_allgather(g, tiled=True)))
      cases.append(Case(
          'assert_equal', label, g.nbytes, 1,
          lambda g=g: multihost.assert_equal(g, timeout=timeout),
          lambda g=g: multihost_utils.assert_equal(g)))
  return cases


# -- reference rows ------------------------------------------------------------


def reference_rows(sizes: list[int], repeats: int, tcp_bytes: int) -> list[Row]:
  rows = []
  ids = iter(range(10**9))

  def coordination_barrier():
    lowlevel.wait_at_barrier(f'multihost-bench-ref/{next(ids)}',
                                  _TIMEOUT.value)

  first, median = time_reference(coordination_barrier, repeats)
  rows.append(Row('coordination service wait_at_barrier', 0, 0,
                  kind='reference', ref_ms=median, ref_first_ms=first,
                  payload='–'))
  mesh = _process_mesh()
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  gather = jax.jit(lambda x: x, out_shardings=replicated)
  psum = jax.jit(jax.shard_map(
      lambda x: jax.lax.psum(x, ('processes', 'local')), mesh=mesh,
      in_specs=jax.P(('processes', 'local')), out_specs=jax.P()))
  for n in sizes:
    if n < 2**20:
      continue
    # Every device holds n bytes: the all-gather moves what process_allgather
    # does; the psum (of n-byte rows) is what a sum-based broadcast does.
    per_device = max(1, n // 4)
    x = _global_rows(mesh, per_device)
    for name, fn in (('plain jitted all-gather (global array)', gather),
                     ('plain jitted psum (global array)', psum)):
      first, median = time_reference(
          lambda fn=fn, x=x: fn(x).block_until_ready(), repeats)
      rows.append(Row(name, n, 1, kind='reference', ref_ms=median,
                      ref_first_ms=first,
                      payload=f'{format_size(n)} per device'))
    del x
  if jax.process_count() > 1:
    rows.append(loopback_tcp(tcp_bytes, repeats))
  rows.extend(torch_rows(sizes, repeats))
  return rows


def _global_rows(mesh: jax.sharding.Mesh, per_device: int) -> jax.Array:
  sharding = jax.sharding.NamedSharding(mesh, jax.P(('processes', 'local')))
  shape = (mesh.size, per_device)
  return jax.make_array_from_callback(
      shape, sharding,
      lambda i: np.full((1, per_device), 1.0, np.float32))


def _recv_exactly(conn: socket.socket, buffer: memoryview) -> None:
  got = 0
  while got < len(buffer):
    n = conn.recv_into(buffer[got:])
    if not n:
      raise ConnectionError('loopback TCP reference: peer closed early')
    got += n


def loopback_tcp(nbytes: int, repeats: int) -> Row:
  """Process 0 sends `nbytes` to process 1 over loopback TCP; 1 acks."""
  pid = jax.process_index()
  server = conn = None
  if pid == 0:
    server = socket.create_server(('127.0.0.1', 0))
    port = server.getsockname()[1]
  else:
    port = None
  port = multihost.broadcast_object(port, timeout=_TIMEOUT.value)
  if pid == 0:
    conn, _ = server.accept()
  elif pid == 1:
    conn = socket.create_connection(('127.0.0.1', port))
  payload = np.random.default_rng(4).integers(0, 255, nbytes, np.uint8)
  buffer = memoryview(bytearray(nbytes))

  def once():
    if pid == 0:
      conn.sendall(payload)
      conn.recv(1)
    elif pid == 1:
      _recv_exactly(conn, buffer)
      conn.sendall(b'k')

  try:
    first, median = time_reference(once, repeats)
  finally:
    if conn is not None:
      conn.close()
    if server is not None:
      server.close()
  rate = nbytes / (median / 1e3) / 1e9
  return Row('loopback TCP, process 0 -> 1', nbytes, 1, kind='reference',
             ref_ms=median, ref_first_ms=first, payload=format_size(nbytes),
             note=f'{rate:.2f} GB/s')


def torch_rows(sizes: list[int], repeats: int) -> list[Row]:
  """torch.distributed gloo reference rows, only when torch is installed."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import torch.distributed as dist  # pylint: disable=import-outside-toplevel
  except ImportError:
    return []
  if jax.process_count() < 2:
    return []
  port = None
  if jax.process_index() == 0:
    from multihost import launch  # pylint: disable=import-outside-toplevel
    port = launch.find_free_port()
  port = multihost.broadcast_object(port, timeout=_TIMEOUT.value)
  dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}',
                          rank=jax.process_index(),
                          world_size=jax.process_count())
  rows = []
  try:
    first, median = time_reference(dist.barrier, repeats)
    rows.append(Row('torch.distributed gloo barrier', 0, 0, kind='reference',
                    ref_ms=median, ref_first_ms=first, payload='–'))
    for n in sizes:
      if n < 2**20:
        continue
      t = torch.ones(n // 4, dtype=torch.float32)
      out = [torch.empty_like(t) for _ in range(jax.process_count())]
      for name, fn in (
          ('torch.distributed gloo broadcast',
           lambda t=t: dist.broadcast(t, 0)),
          ('torch.distributed gloo all_gather',
           lambda t=t, out=out: dist.all_gather(out, t)),
          ('torch.distributed gloo all_reduce',
           lambda t=t: dist.all_reduce(t))):
        first, median = time_reference(fn, repeats)
        rows.append(Row(name, n, 1, kind='reference', ref_ms=median,
                        ref_first_ms=first, payload=format_size(n)))
  finally:
    dist.destroy_process_group()
  return rows


# -- recovery ------------------------------------------------------------------


def recovery_rows(width: int, repeats: int, sharded: bool,
                  parent: str) -> list[Row]:
  """Checkpoint save + restore (+ verification) vs plain Orbax; see above."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  import recovery  # pylint: disable=import-outside-toplevel

  mesh = jax.make_mesh((jax.device_count(),), ('data',))
  count = jax.device_count()
  if sharded and width % count:
    raise app.UsageError(f'--width={width} must be a multiple of the device '
                         f'count ({count}) with --recovery_sharding=sharded.')
  sharding = jax.sharding.NamedSharding(mesh,
                                        jax.P('data') if sharded else jax.P())

  def placed(a: np.ndarray) -> jax.Array:
    return jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])

  rng = np.random.default_rng(6)
  state = recovery.TransitionState(
      user={'weights': placed(rng.standard_normal(width, np.float32)),
            'momentum': placed(rng.standard_normal(width, np.float32))},
      key=jax.random.key(7), order=np.arange(64, dtype=np.int32), cursor=8,
      epoch=1, step=1)
  target = state.replace(
      user=jax.tree.map(lambda x: placed(np.zeros(x.shape, x.dtype)),
                        state.user), step=0)
  tree = state.to_tree()
  abstract = jax.tree.map(_abstract, tree)
  nbytes = sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
               for x in jax.tree.leaves(tree))
  leaves = len(jax.tree.leaves(tree))

  root = None
  if jax.process_index() == 0:
    root = tempfile.mkdtemp(prefix='multihost-bench-',
                            dir=parent or None)
  root = multihost.broadcast_object(root, timeout=_TIMEOUT.value)

  def ours(folder: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    checkpoints = recovery.Checkpoints(folder, save_every=1, keep=1,
                                       async_save=True)
    checkpoints.save(state, force=True)
    checkpoints.wait()
    t1 = time.perf_counter()
    restored = checkpoints.restore(target, step=state.step)
    jax.block_until_ready(restored.user)
    t2 = time.perf_counter()
    checkpoints.close()
    return t1 - t0, t2 - t1

  def plain(folder: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(folder, 'state'), tree)
    checkpointer.wait_until_finished()
    t1 = time.perf_counter()
    restored = checkpointer.restore(os.path.join(folder, 'state'), abstract)
    jax.block_until_ready(restored)
    t2 = time.perf_counter()
    checkpointer.close()
    return t1 - t0, t2 - t1

  results: dict[str, list[tuple[float, float]]] = {'ours': [], 'plain': []}
  firsts = {}
  try:
    for r in range(repeats + 1):
      for name, fn in (('ours', ours), ('plain', plain)):
        folder = os.path.join(root, f'{name}-{r}')
        barrier()
        timing = fn(folder)
        barrier()
        if jax.process_index() == 0:
          shutil.rmtree(folder, ignore_errors=True)
        if r == 0:
          firsts[name] = timing  # Untimed round: first call of each.
        else:
          results[name].append(timing)
  finally:
    barrier()
    if jax.process_index() == 0:
      shutil.rmtree(root, ignore_errors=True)

  def summary(name: str, phase: int | None) -> tuple[float, float]:
    per_iter = [t[phase] if phase is not None else t[0] + t[1]
                for t in results[name]]
    first = (firsts[name][phase] if phase is not None
             else sum(firsts[name]))
    return (ms(statistics.median(slowest(per_iter))),
            ms(slowest_one(first)))

  rows = []
  label = (f'{nbytes / 2**20:.4g} MiB, {leaves} leaves, '
           f'{_RECOVERY_SHARDING.value}')
  for phase, what in ((0, 'save (async, until committed)'),
                      (1, 'restore (+ digest and agreement checks)'),
                      (None, 'save + restore + verification')):
    ours_ms, ours_first = summary('ours', phase)
    plain_ms, plain_first = summary('plain', phase)
    rows.append(Row(f'recovery: {what}', nbytes, leaves, kind='recovery',
                    ours_ms=ours_ms, jax_ms=plain_ms, ours_first_ms=ours_first,
                    jax_first_ms=plain_first, payload=label,
                    note='jax_ms: plain orbax StandardCheckpointer'))
  return rows


def _abstract(x):
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return np.asarray(x)


# -- output --------------------------------------------------------------------


def _f(value: float | None, digits: int = 2) -> str:
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
  lines = []
  compare = [r for r in rows if r.kind == 'compare']
  if compare:
    lines += [
        '| op | payload | ours ms | jax ms | ours/jax | ours first ms | '
        'jax first ms | ours peak +MiB | jax peak +MiB | note |',
        '|---|---|---|---|---|---|---|---|---|---|']
    for r in compare:
      lines.append(
          f'| {r.op} | {r.payload} | {_f(r.ours_ms)} | {_f(r.jax_ms)} | '
          f'{_f(r.ratio, 3)} | {_f(r.ours_first_ms)} | {_f(r.jax_first_ms)} | '
          f'{_mib(r.ours_peak_bytes)} | {_mib(r.jax_peak_bytes)} | {r.note} |')
  refs = [r for r in rows if r.kind == 'reference']
  if refs:
    lines += ['', '| reference | payload | median ms | first ms | note |',
              '|---|---|---|---|---|']
    for r in refs:
      lines.append(f'| {r.op} | {r.payload} | {_f(r.ref_ms)} | '
                   f'{_f(r.ref_first_ms)} | {r.note} |')
  rec = [r for r in rows if r.kind == 'recovery']
  if rec:
    lines += ['', '| recovery | state | recovery.Checkpoints ms | plain Orbax '
              'StandardCheckpointer ms | ratio | first: ours / orbax ms |',
              '|---|---|---|---|---|---|']
    for r in rec:
      lines.append(f'| {r.op[len("recovery: "):]} | {r.payload} | '
                   f'{_f(r.ours_ms)} | {_f(r.jax_ms)} | {_f(r.ratio, 3)} | '
                   f'{_f(r.ours_first_ms)} / {_f(r.jax_first_ms)} |')
  return '\n'.join(lines)


def _load() -> str:
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


def _header() -> str:
  load = _load()
  now = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M')
  return (f'multihost bench: {jax.process_count()} processes x '
          f'{jax.local_device_count()} {jax.devices()[0].platform} devices; '
          f'jax {jax.__version__}; python {platform.python_version()}; '
          f'{os.cpu_count()} cores; load {load}; {now} UTC; repeats '
          f'{_REPEATS.value}, warm-up {_WARMUP.value}.\n{_source()}.')


def main(argv):
  del argv  # Unused.
  if _RECOVERY.value:
    import recovery  # pylint: disable=import-outside-toplevel
    recovery.quiet_orbax_logs()
  multihost.initialize()
  if _QUICK.value:
    for name, value in (('sizes', ['8', '1KiB']), ('leaves', 10),
                        ('global_sizes', ['1MiB']), ('repeats', 3),
                        ('warmup', 1), ('tcp_bytes', '1MiB'),
                        ('width', 4096), ('recovery_repeats', 1)):
      if not flags.FLAGS[name].present:
        setattr(flags.FLAGS, name, value)
  known = {'sync_global_devices', 'broadcast_one_to_all', 'process_allgather',
           'assert_equal', 'global', 'reference'}
  ops = [o for o in _OPS.value if o]
  unknown = sorted(set(ops) - known)
  if unknown:
    raise app.UsageError(f'--ops: unknown {unknown}; choose from '
                         f'{sorted(known)}.')
  if jax.process_count() < 2:
    logging.warning('Running as a single controller: both implementations '
                    'take their one-process fast paths. Run under '
                    '`python -m multihost.launch --num_processes=2`.')
  sizes = [parse_size(s) for s in _SIZES.value]
  global_sizes = [parse_size(s) for s in _GLOBAL_SIZES.value]
  pid = jax.process_index()
  say = (lambda *a: print(*a, flush=True)) if pid == 0 else (lambda *a: None)
  say(_header())

  # Set up gloo's connections once, so no case's first call pays for it.
  mesh = _process_mesh()
  warm = jax.jit(lambda x: x, out_shardings=jax.sharding.NamedSharding(
      mesh, jax.P()))
  warm(_global_rows(mesh, 4)).block_until_ready()
  barrier()

  rows: list[Row] = []
  start = time.perf_counter()
  for i, case in enumerate(build_cases(ops, sizes, _LEAVES.value,
                                       global_sizes)):
    row = run_case(case, i)
    rows.append(row)
    say(f'[{time.perf_counter() - start:6.1f} s] {case.op} {case.payload}: '
        f'ours {_f(row.ours_ms)} ms, jax {_f(row.jax_ms)} ms, ratio '
        f'{_f(row.ratio, 3)}; first {_f(row.ours_first_ms)} / '
        f'{_f(row.jax_first_ms)} ms {row.note}')
  if 'reference' in ops:
    rows += reference_rows(sizes, _REPEATS.value, parse_size(_TCP_BYTES.value))
    say(f'[{time.perf_counter() - start:6.1f} s] reference rows done')
  if _RECOVERY.value:
    rows += recovery_rows(_WIDTH.value, _RECOVERY_REPEATS.value,
                          _RECOVERY_SHARDING.value == 'sharded',
                          _RECOVERY_DIR.value)
    say(f'[{time.perf_counter() - start:6.1f} s] recovery benchmark done')
  if pid == 0:
    print(f'\nLoad average at the end: {_load()}.\n'
          + ' '.join(['python', *sys.argv]) + '\n' + render(rows), flush=True)
    if _JSON.value:
      with open(_JSON.value, 'w') as f:
        for r in rows:
          f.write(json.dumps(r.to_json()) + '\n')
  barrier()


if __name__ == '__main__':
  app.run(main)
