"""Public functions: host-local <-> global jax.Array conversion, for any device order (no communication)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from multihost import _diagnostics
from multihost import _leaves

PyTree = Any
_NONE_SPEC = ('`None` is not a valid partition spec for {what}. Use '
              'jax.sharding.PartitionSpec() (jax.P()) to replicate the value.')


def host_local_array_to_global_array(local_inputs: PyTree,
                                     global_mesh: jax.sharding.Mesh,
                                     pspecs: Any) -> PyTree:
  """Builds global jax.Arrays from each process's host-local values.

  Not a collective (no communication), but every process must call it with
  the same mesh and specs, and with its own part of the data.

  Drop-in for the function of the same name in
  `jax.experimental.multihost_utils`. Each process's local value is laid out
  over its own devices as `NamedSharding(local mesh, pspec)` and becomes its
  part of the global array `NamedSharding(global_mesh, pspec)`. Along a mesh
  axis that spans processes the global dimension is the local one times the
  number of process groups along it; along replicated dimensions it equals
  the local one. Unlike JAX's, it also works when the mesh's devices are not
  grouped by process (any device order), as long as each process's devices
  form a sub-grid of the mesh.

  * An input that is already a global (not fully addressable) array is
    returned as is (the same object).
  * A jax.Array already laid out as the local sharding keeps its buffers
    (no copy).

  Args:
    local_inputs: pytree of host-local arrays (numpy, jax.Array, scalars).
    global_mesh: the mesh of the global arrays.
    pspecs: a PartitionSpec, or a pytree prefix of `local_inputs` of them.

  Returns:
    A pytree of global jax.Arrays.
  """
  return _map_leaves(_to_global, local_inputs, global_mesh, pspecs)


def global_array_to_host_local_array(global_inputs: PyTree,
                                     global_mesh: jax.sharding.Mesh,
                                     pspecs: Any) -> PyTree:
  """Returns this process's host-local part of each global jax.Array.

  Not a collective unless an input must be resharded to `pspecs` first
  (then every process must call it, in the same order).

  The inverse of `host_local_array_to_global_array`: the result is a
  jax.Array over this process's devices, laid out as
  `NamedSharding(local mesh, pspec)`, that shares the global array's
  buffers. Fully addressable inputs are returned as they are.

  Args:
    global_inputs: pytree of global jax.Arrays.
    global_mesh: their mesh.
    pspecs: a PartitionSpec, or a pytree prefix of `global_inputs` of them.

  Returns:
    A pytree of host-local jax.Arrays.
  """
  return _map_leaves(_to_local, global_inputs, global_mesh, pspecs)


def _map_leaves(convert, tree: PyTree, mesh: jax.sharding.Mesh,
                pspecs: Any) -> PyTree:
  """`convert(leaf, mesh, local mesh, spec)` over the tree's leaves."""
  specs = _broadcast_specs(pspecs, tree, 'pspecs')
  local_mesh = _local_mesh(mesh)
  leaves, treedef = jax.tree.flatten(tree)
  return treedef.unflatten([convert(x, mesh, local_mesh, s)
                            for x, s in zip(leaves, specs, strict=True)])


def _is_spec(x) -> bool:
  return x is None or isinstance(x, jax.sharding.PartitionSpec)


def _broadcast_specs(pspecs, tree, what: str) -> list:
  if pspecs is None:
    raise ValueError(_NONE_SPEC.format(what=what))
  try:
    full = jax.tree.broadcast(pspecs, tree, is_leaf=_is_spec)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f'{what} must be a PartitionSpec or a pytree prefix of the inputs '
        f'whose leaves are PartitionSpecs; got {pspecs!r}: {e}') from None
  specs = jax.tree.leaves(full, is_leaf=_is_spec)
  if any(s is None for s in specs):
    raise ValueError(_NONE_SPEC.format(what=what))
  return specs


def _local_mesh(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
  """The sub-grid of `mesh` made of this process's devices, in mesh order."""
  me = jax.process_index()
  is_local = np.vectorize(lambda d: d.process_index == me)(mesh.devices)
  if not is_local.any():
    raise ValueError(
        f'{_diagnostics.prefix(me)} the mesh has no device of this process: '
        f'{mesh}.')
  coords = [np.flatnonzero(is_local.any(axis=tuple(
      a for a in range(mesh.devices.ndim) if a != axis)))
            for axis in range(mesh.devices.ndim)]
  sub = mesh.devices[np.ix_(*coords)]
  if not np.vectorize(lambda d: d.process_index == me)(sub).all() or (
      sub.size != is_local.sum()):
    raise ValueError(
        f'{_diagnostics.prefix(me)} this process\'s devices do not form a sub-grid of '
        f'the mesh (axes {mesh.axis_names}, shape {mesh.devices.shape}), so '
        'there is no host-local layout for them. Arrange the mesh so that '
        'each process\'s devices sit at the crossings of some rows/columns, '
        'or use jax.make_array_from_single_device_arrays directly.')
  return jax.sharding.Mesh(sub, mesh.axis_names)


def _axis_sizes(mesh: jax.sharding.Mesh, entry) -> int:
  if entry is None:
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  return int(np.prod([mesh.shape[n] for n in names]))


def _scale(spec, ndim, big: jax.sharding.Mesh, small: jax.sharding.Mesh):
  """Per dimension: (size along `big`) / (size along `small`) of the spec."""
  entries = tuple(spec) + (None,) * (ndim - len(spec))
  out = []
  for e in entries[:ndim]:
    b, s = _axis_sizes(big, e), _axis_sizes(small, e)
    out.append((b, s))
  return out


def _to_global(x, mesh, local_mesh, spec):
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return x
  _leaves.require_not_tracer(x, 'host_local_array_to_global_array')
  global_sharding = jax.sharding.NamedSharding(mesh, spec)
  local_sharding = jax.sharding.NamedSharding(local_mesh, spec)
  if not isinstance(x, jax.Array):
    x = np.asarray(x)
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)
    if x.dtype != dtype:
      x = x.astype(dtype)
  shape = []
  for n, (b, s) in zip(x.shape, _scale(spec, x.ndim, mesh, local_mesh),
                       strict=True):
    if n % s:
      raise ValueError(
          f'{_diagnostics.prefix()} host_local_array_to_global_array:'
          f' a local dimension of size {n} cannot be split over {s} local '
          f'devices (spec {spec}, local shape {x.shape}).')
    shape.append(n // s * b)
  shape = tuple(shape)
  if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(
      local_sharding, x.ndim):
    arrays = [s.data for s in x.addressable_shards]  # Shares the buffers.
  else:
    index_map = local_sharding.addressable_devices_indices_map(x.shape)
    devices = list(index_map)
    arrays = jax.device_put([x[index_map[d]] for d in devices], devices)
  return jax.make_array_from_single_device_arrays(shape, global_sharding,
                                                  arrays)


def _to_local(x, mesh, local_mesh, spec):
  if isinstance(x, jax.Array) and x.is_fully_addressable:
    return x
  global_sharding = jax.sharding.NamedSharding(mesh, spec)
  local_sharding = jax.sharding.NamedSharding(local_mesh, spec)
  if not isinstance(x, jax.Array):
    x = jax.make_array_from_callback(np.shape(x), global_sharding,
                                     lambda index: np.asarray(x)[index])
  elif not x.sharding.is_equivalent_to(global_sharding, x.ndim):
    x = jax.device_put(x, global_sharding)
  shape = []
  for n, (b, s) in zip(x.shape, _scale(spec, x.ndim, mesh, local_mesh),
                       strict=True):
    shape.append(n // b * s)
  arrays = [s.data for s in x.addressable_shards]  # Shares the buffers.
  return jax.make_array_from_single_device_arrays(tuple(shape), local_sharding,
                                                  arrays)
