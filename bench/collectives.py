"""The comparison cases: each collective of ours next to JAX's, on the same inputs.

Inputs are numpy arrays; broadcast gets process 0's data and zeros
elsewhere, allgather different data per process, assert_equal equal data.
The `global` cases use a float32 array sharded over every device.
"""

from __future__ import annotations

import jax
from jax.experimental import multihost_utils
import numpy as np

import multihost

from bench.harness import Case
from bench.harness import format_size

# What --ops may name.
OPS = ('sync_global_devices', 'broadcast_one_to_all', 'process_allgather',
       'assert_equal', 'global')

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
                global_sizes: list[int], *, timeout: float) -> list[Case]:
  """The comparison cases, in run order; ours get `timeout` seconds."""
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
