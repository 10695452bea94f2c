"""The comparison cases: each collective of ours next to JAX's, on the same inputs.

Inputs are numpy arrays; broadcast gets process 0's data and zeros
elsewhere, allgather different data per process, assert_equal equal data.
The `global` cases use a float32 array sharded over every device.
`source`: an explicit is_source (the last process). `skew`: the last process
arrives late by 5 ms and by 2 s (timed from the common barrier, so the row
includes the lateness). `mismatch`: processes pass different shapes; ours
raises ConsistencyError (the row is the time to the error; JAX has no check).
`objects`: broadcast_object/allgather_object against their JAX-based
equivalents (pickle, then broadcast_one_to_all/process_allgather of the
bytes, with the lengths first).
"""

from __future__ import annotations

import pickle
import time

import jax
from jax.experimental import multihost_utils
import numpy as np

from bench.harness import Case
from bench.harness import format_size
import multihost

# What --ops may name.
OPS = ('sync_global_devices', 'broadcast_one_to_all', 'process_allgather',
       'assert_equal', 'global', 'source', 'skew', 'mismatch', 'objects',
       'convert')

_OURS = {'broadcast_one_to_all': multihost.broadcast_one_to_all,
         'process_allgather': multihost.process_allgather,
         'assert_equal': multihost.assert_equal}
_THEIRS = {'broadcast_one_to_all': multihost_utils.broadcast_one_to_all,
           'process_allgather': multihost_utils.process_allgather,
           'assert_equal': multihost_utils.assert_equal}


def process_mesh() -> jax.sharding.Mesh:
  """All devices, (processes, local devices), as JAX's multihost_utils uses."""
  devices = np.array(jax.devices()).reshape(jax.process_count(),
                                            jax.local_device_count())
  return jax.sharding.Mesh(devices, ('processes', 'local'))


def global_rows(mesh: jax.sharding.Mesh, per_device: int) -> jax.Array:
  """Ones, [devices, per_device] float32, one row on each device."""
  sharding = jax.sharding.NamedSharding(mesh, jax.P(('processes', 'local')))
  shape = (mesh.size, per_device)
  return jax.make_array_from_callback(
      shape, sharding,
      lambda i: np.full((1, per_device), 1.0, np.float32))


def warm_up_gloo() -> None:
  """One plain jitted all-gather, so no case's first call sets up gloo.

  Collective: every process must call this, in the same order.
  """
  mesh = process_mesh()
  warm = jax.jit(lambda x: x, out_shardings=jax.sharding.NamedSharding(
      mesh, jax.P()))
  warm(global_rows(mesh, 4)).block_until_ready()


def _data(nbytes: int, seed: int) -> np.ndarray:
  n = max(1, nbytes // 4)
  return np.random.default_rng(seed).random(n, dtype=np.float32)


def _tree(leaves: int, seed: int) -> dict[str, np.ndarray]:
  # int32 leaves: not the float32 shapes of the single-leaf cases, so that
  # those cases' first calls compile their own programs.
  rng = np.random.default_rng(seed)
  return {f'leaf{i:03d}': rng.integers(0, 2**31 - 1, 2, dtype=np.int32)
          for i in range(leaves)}


def _global_array(nbytes: int, seed: int) -> jax.Array:
  """A float32 array of `nbytes` sharded over every device of every process."""
  mesh = process_mesh()
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


def build_cases(ops: list[str], sizes: list[int], leaves: int,
                global_sizes: list[int], *, timeout: float,
                on_device: bool = False) -> list[Case]:
  """The comparison cases, in run order; ours get `timeout` seconds.

  `on_device`: the single-leaf cases' inputs are jax.Arrays on this
  process's first local device (a GPU's memory, say) instead of numpy arrays.
  """
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
      label = format_size(x.nbytes)
      if on_device:
        x = jax.device_put(x, jax.local_devices()[0])
        label += f' on {x.device.platform}'
      cases.append(Case(
          op, label, x.nbytes, 1,
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


def _late(fn, delay: float):
  """`fn`, called after `delay` s on the last process (arrival skew)."""
  last = jax.process_index() == jax.process_count() - 1
  def call():
    if last:
      time.sleep(delay)
    return fn()
  return call


def _error_name(fn):
  """`fn`, returning the name of the exception it raises (None if none)."""
  def call():
    try:
      fn()
    except Exception as e:  # pylint: disable=broad-except
      return type(e).__name__
    return None
  return call


def _blob(nbytes: int, seed: int) -> bytes:
  return np.random.default_rng(seed).integers(
      0, 256, nbytes, dtype=np.uint8).tobytes()


def jax_broadcast_object(obj, is_source: bool):
  """JAX-based broadcast_object: pickle, the length, then the bytes."""
  data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if is_source else b''
  n = int(multihost_utils.broadcast_one_to_all(
      np.int32(len(data)), is_source=is_source))
  buf = (np.frombuffer(data, np.uint8) if is_source
         else np.zeros(n, np.uint8))
  out = multihost_utils.broadcast_one_to_all(buf, is_source=is_source)
  return obj if is_source else pickle.loads(np.asarray(out).tobytes())


def jax_allgather_object(obj):
  """JAX-based allgather_object: pickle, the lengths, then padded bytes."""
  data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
  sizes = multihost_utils.process_allgather(np.int32(len(data)))
  buf = np.zeros(int(sizes.max()), np.uint8)
  buf[:len(data)] = np.frombuffer(data, np.uint8)
  rows = np.asarray(multihost_utils.process_allgather(buf))
  me = jax.process_index()
  return [obj if p == me else pickle.loads(rows[p, :int(n)].tobytes())
          for p, n in enumerate(sizes)]


def build_extra_cases(ops: list[str], *, object_sizes: list[int],
                      skews: list[float], timeout: float,
                      slow_repeats: int) -> list[Case]:
  """The source, skew, mismatch and object cases, in run order."""
  pid, count = jax.process_index(), jax.process_count()
  last = pid == count - 1
  cases = []
  if 'source' in ops:
    for n in (1024, 2**20):
      x = _data(n, 7) if last else np.zeros(n // 4, np.float32)
      cases.append(Case(
          'broadcast_one_to_all(is_source=last)', format_size(n), n, 1,
          lambda x=x: multihost.broadcast_one_to_all(
              x, is_source=last, timeout=timeout),
          lambda x=x: multihost_utils.broadcast_one_to_all(
              x, is_source=last)))
  if 'skew' in ops:
    for delay in skews:
      x = _data(1024, 8 + pid)
      label = f'1 KiB, last process {delay * 1e3:g} ms late'
      repeats = slow_repeats if delay >= 0.5 else None
      for name, ours, theirs in (
          ('broadcast_one_to_all', multihost.broadcast_one_to_all,
           multihost_utils.broadcast_one_to_all),
          ('process_allgather', multihost.process_allgather,
           multihost_utils.process_allgather)):
        cases.append(Case(
            name, label, 1024, 1,
            _late(lambda x=x, f=ours: f(x, timeout=timeout), delay),
            _late(lambda x=x, f=theirs: f(x), delay), repeats=repeats))
  if 'mismatch' in ops:
    x = np.zeros(256 + pid, np.float32)  # Shapes differ by process.
    cases.append(Case(
        'process_allgather', 'mismatched shapes (time to the error)',
        x.nbytes, 1,
        _error_name(lambda x=x: multihost.process_allgather(
            x, timeout=timeout)),
        None, expected='ConsistencyError', repeats=slow_repeats))
  if 'objects' in ops:
    for n in object_sizes:
      src = _blob(n, 9) if pid == 0 else None
      cases.append(Case(
          'broadcast_object', f'{format_size(n)} bytes object', n, 1,
          lambda o=src: multihost.broadcast_object(o, timeout=timeout),
          lambda o=src: jax_broadcast_object(o, pid == 0)))
      mine = _blob(n, 10 + pid)
      cases.append(Case(
          'allgather_object', f'{format_size(n)} bytes object', n, 1,
          lambda o=mine: multihost.allgather_object(o, timeout=timeout),
          lambda o=mine: jax_allgather_object(o)))
  return cases


def _round_trip(module, tree, mesh, spec):
  """host_local_array_to_global_array, then back (the input path's pair).

  Waits for the result: both place the host values with an asynchronous
  copy (inputs that are not 64-byte aligned are copied, not aliased), so
  without the wait only the dispatch would be timed.
  """
  g = module.host_local_array_to_global_array(tree, mesh, spec)
  return jax.block_until_ready(
      module.global_array_to_host_local_array(g, mesh, spec))


def build_convert_cases(ops: list[str], sizes: list[int],
                        leaves: int) -> list[Case]:
  """Host-local -> global -> host-local of a batch sharded over every device."""
  if 'convert' not in ops:
    return []
  mesh = process_mesh()
  spec = jax.P(('processes', 'local'))
  local = jax.local_device_count()
  pid = jax.process_index()
  inputs = []
  if leaves:
    rng = np.random.default_rng(11 + pid)
    tree = {f'leaf{i:03d}': rng.integers(0, 99, 2 * local, dtype=np.int32)
            for i in range(leaves)}
    inputs.append((f'{leaves} leaves × {8 * local} B', 8 * local * leaves,
                   leaves, tree))
  for n in sizes:
    count = max(local, n // 4 // local * local)
    x = np.random.default_rng(12 + pid).random(count, dtype=np.float32)
    inputs.append((format_size(x.nbytes), x.nbytes, 1, x))
  # Local (no communication): each timed sample is several round trips back
  # to back after one barrier, so neither the barrier's aftermath on this
  # 2-core machine (~0.1 ms, more than a small round trip) nor one
  # scheduling hiccup (4 processes share 2 cores at P=4) is what is timed.
  # 100 for a single leaf up to 1 MiB (~0.04-0.3 ms each), else 5.
  return [Case('host_local -> global -> host_local', label, nbytes, k,
               lambda t=tree: _round_trip(multihost, t, mesh, spec),
               lambda t=tree: _round_trip(multihost_utils, t, mesh, spec),
               calls=100 if k == 1 and nbytes <= 1 << 20 else 5)
          for label, nbytes, k, tree in inputs]
