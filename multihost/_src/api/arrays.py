"""Public functions: host-local <-> global jax.Array conversion, for any device order (no communication)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from multihost._src.runtime import failures

PyTree = Any
# JAX's words first (code may match them), then which spec was None.
_NONE_SPEC = ('`None` is not a valid input to the pspecs argument. Please use '
              'jax.sharding.PartitionSpec() if you wanted to replicate your '
              'input. ({what} holds None where a PartitionSpec belongs; '
              'jax.P() replicates the value.)')


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
    (no copy). On CPU devices, a numpy slice of 256 KiB or more that is not
    64-byte aligned (which the device would copy) is copied once into
    aligned memory that the result then owns; an aligned one is used in
    place, as JAX's. Other devices get each slice as it is, as JAX's.
  * Inside `jax.jit` (a traced input) it is the identity laid out as the
    global sharding, as JAX's, where the local and global shapes are equal
    (one process, or a spec replicated across processes); else ValueError.

  Args:
    local_inputs: pytree of host-local arrays (numpy, jax.Array, scalars).
    global_mesh: the mesh of the global arrays.
    pspecs: a PartitionSpec, or a pytree prefix of `local_inputs` of them.

  Returns:
    A pytree of global jax.Arrays.
  """
  if (type(local_inputs) is np.ndarray  # pylint: disable=unidiomatic-typecheck
      and isinstance(pspecs, jax.sharding.PartitionSpec)):
    # One NumPy array (a batch): no tree to flatten and rebuild.
    return _to_global(local_inputs, _layout(global_mesh, pspecs))[1]
  leaves, treedef, layouts = _leaves_and_layouts(local_inputs, global_mesh,
                                                 pspecs)
  return treedef.unflatten(_to_global_all(leaves, layouts))


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
  leaves, treedef, layouts = _leaves_and_layouts(global_inputs, global_mesh,
                                                 pspecs)
  return treedef.unflatten([_to_local(x, layout) for x, layout in zip(
      leaves, layouts, strict=True)])


def _leaves_and_layouts(tree: PyTree, mesh: jax.sharding.Mesh, pspecs: Any):
  """The tree's leaves, its treedef, and each leaf's `_Layout`."""
  leaves, treedef = jax.tree.flatten(tree)
  if isinstance(pspecs, jax.sharding.PartitionSpec):  # The common case.
    layouts = [_layout(mesh, pspecs)] * len(leaves)
  else:
    layouts = [_layout(mesh, s)
               for s in _broadcast_specs(pspecs, tree, 'pspecs')]
  return leaves, treedef, layouts


class _Layout:
  """What a (mesh, spec) pair fixes: both shardings and the per-dim scales."""
  __slots__ = ('mesh', 'spec', 'local_mesh', 'global_sharding',
               'local_sharding', '_scales', 'all_local', 'on_cpu', '_plans')

  def __init__(self, mesh: jax.sharding.Mesh, spec):
    self.mesh = mesh
    self.spec = spec
    self.local_mesh = _local_mesh(mesh)
    self.global_sharding = jax.sharding.NamedSharding(mesh, spec)
    self.local_sharding = jax.sharding.NamedSharding(self.local_mesh, spec)
    self.all_local = self.local_mesh.devices.size == mesh.devices.size
    # Host memory is the device's: `_placeable` pays off only there.
    self.on_cpu = all(d.platform == 'cpu' for d in self.local_mesh.devices.flat)
    self._scales: dict[int, list[tuple[int, int]]] = {}
    self._plans: dict[tuple[int, ...], _Plan] = {}

  def scales(self, ndim: int) -> list[tuple[int, int]]:
    """Per dimension: (size along the mesh, size along the local mesh)."""
    out = self._scales.get(ndim)
    if out is None:
      out = self._scales[ndim] = _scale(self.spec, ndim, self.mesh,
                                        self.local_mesh)
    return out

  def plan(self, local_shape: tuple[int, ...]) -> _Plan:
    """The cached `_Plan` of a host-local value of this shape."""
    out = self._plans.get(local_shape)
    if out is None:
      if len(self._plans) > 256:
        self._plans.clear()
      out = self._plans[local_shape] = _Plan(self, local_shape)
    return out


def _index_key(index) -> tuple:
  """A hashable form of a tuple of slices (slices hash only from 3.12)."""
  return tuple((s.start, s.stop, s.step) for s in index)


class _Plan:
  """What a (layout, local shape) fixes: the global shape and, per global
  shard index of this process's devices, the local index holding its data."""
  __slots__ = ('global_shape', 'local_index', 'on_cpu')

  def __init__(self, layout: _Layout, local_shape: tuple[int, ...]):
    shape = []
    for n, (b, s) in zip(local_shape, layout.scales(len(local_shape)),
                         strict=True):
      if n % s:
        raise ValueError(
            f'{failures.prefix()} host_local_array_to_global_array:'
            f' a local dimension of size {n} cannot be split over {s} local '
            f'devices (spec {layout.spec}, local shape {local_shape}).')
      shape.append(n // s * b)
    self.global_shape = tuple(shape)
    local = layout.local_sharding.devices_indices_map(local_shape)
    glob = layout.global_sharding.addressable_devices_indices_map(
        self.global_shape)
    self.local_index = {_index_key(glob[d]): local[d] for d in local}
    self.on_cpu = layout.on_cpu

  def slicer(self, x: np.ndarray):
    """The data callback of `jax.make_array_from_callback` for `x`."""
    if x.ndim == 0:
      return lambda index: x
    local_index = self.local_index
    if not self.on_cpu:  # The transfer to the device reads `x` as it is.
      return lambda index: x[local_index[_index_key(index)]]
    return lambda index: _placeable(x[local_index[_index_key(index)]])


# A CPU device takes a host array without copying it when the array is
# C-contiguous and 64-byte aligned; otherwise the runtime copies it into
# memory of its own, which it touches page by page: several times slower than
# a NumPy copy into huge-page-backed memory (measured when this was tuned;
# no doc keeps those numbers now).
# So a large slice that would be copied anyway is copied here, into an
# aligned buffer that nothing else holds (then aliasing it is safe). Small
# ones are cheaper to leave to the runtime. Other devices (a TPU's, a GPU's)
# copy the host bytes over as they are, aligned or not: a copy here would
# only add one (docs/performance.md, "Beside a training step").
_ALIGN = 64
_COPY_FROM = 256 << 10


def _placeable(x: np.ndarray) -> np.ndarray:
  """`x`, or an aligned private copy of it when the device would copy it anyway."""
  if x.nbytes < _COPY_FROM or (x.flags.c_contiguous
                               and x.ctypes.data % _ALIGN == 0):
    return x
  buffer = np.empty(x.nbytes + _ALIGN, np.uint8)
  start = -buffer.ctypes.data % _ALIGN
  out = buffer[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
  np.copyto(out, x)
  return out


# Per (mesh, spec); meshes and specs are hashable and few in a program.
_layouts: dict[tuple[Any, Any], _Layout] = {}


def _layout(mesh: jax.sharding.Mesh, spec) -> _Layout:
  key = (mesh, spec)
  try:
    return _layouts[key]
  except KeyError:
    pass
  if len(_layouts) > 256:
    _layouts.clear()
  layout = _layouts[key] = _Layout(mesh, spec)
  return layout


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
        f'{failures.prefix(me)} the mesh has no device of this process: '
        f'{mesh}.')
  coords = [np.flatnonzero(is_local.any(axis=tuple(
      a for a in range(mesh.devices.ndim) if a != axis)))
            for axis in range(mesh.devices.ndim)]
  sub = mesh.devices[np.ix_(*coords)]
  if not np.vectorize(lambda d: d.process_index == me)(sub).all() or (
      sub.size != is_local.sum()):
    raise ValueError(
        f'{failures.prefix(me)} this process\'s devices do not form a sub-grid of '
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


def _to_global_all(leaves: list, layouts: list[_Layout]) -> list:
  """`_to_global` of every leaf, with one device_put for all that need one.

  One batched device_put is the cheapest public way to place many leaves
  (each separate put costs a dispatch).
  """
  out, pending = [], []
  for i, (x, layout) in enumerate(zip(leaves, layouts, strict=True)):
    done, x, shape = _to_global(x, layout)
    out.append(x if done else None)
    if not done:
      pending.append((i, x, shape))
  if pending:
    placed = jax.device_put([x for _, x, _ in pending],
                            [layouts[i].local_sharding for i, _, _ in pending])
    for (i, _, shape), y in zip(pending, placed, strict=True):
      layout = layouts[i]
      if layout.all_local:  # One process: the local layout is the global one.
        out[i] = y
      else:
        out[i] = jax.make_array_from_single_device_arrays(
            shape, layout.global_sharding,
            [s.data for s in y.addressable_shards])
  return out


def _to_global(x, layout: _Layout):
  """(True, the global array, None), or (False, host value, global shape)."""
  if isinstance(x, jax.core.Tracer):
    return True, _traced(x, layout, to_global=True), None
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return True, x, None
  if not isinstance(x, jax.Array):
    x = np.asarray(x)
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)
    if x.dtype != dtype:
      x = x.astype(dtype)
    plan = layout.plan(x.shape)
    # As JAX's (a slice per device, one batched put), through the public
    # make_array_from_callback: no local array is built in between. No
    # dtype= (the slices have it; this process has a device of the mesh):
    # its check cost 1.7 us a call on CPU, a tenth of the call.
    return True, jax.make_array_from_callback(
        plan.global_shape, layout.global_sharding, plan.slicer(x)), None
  shape = layout.plan(x.shape).global_shape
  local_sharding = layout.local_sharding
  if isinstance(x, jax.Array) and (
      x.sharding == local_sharding
      or x.sharding.is_equivalent_to(local_sharding, x.ndim)):
    if layout.all_local:
      return True, x, None
    arrays = [s.data for s in x.addressable_shards]  # Shares the buffers.
    return True, jax.make_array_from_single_device_arrays(
        shape, layout.global_sharding, arrays), None
  return False, x, shape


def _to_local(x, layout: _Layout):
  if isinstance(x, jax.core.Tracer):
    return _traced(x, layout, to_global=False)
  if isinstance(x, jax.Array) and x.is_fully_addressable:
    return x
  global_sharding = layout.global_sharding
  if not isinstance(x, jax.Array):
    x = jax.make_array_from_callback(np.shape(x), global_sharding,
                                     lambda index: np.asarray(x)[index])
  elif not (x.sharding == global_sharding
            or x.sharding.is_equivalent_to(global_sharding, x.ndim)):
    x = jax.device_put(x, global_sharding)
  shape = tuple(n // b * s for n, (b, s) in zip(
      x.shape, layout.scales(x.ndim), strict=True))
  arrays = [s.data for s in x.addressable_shards]  # Shares the buffers.
  return jax.make_array_from_single_device_arrays(
      shape, layout.local_sharding, arrays)


def _traced(x, layout: _Layout, *, to_global: bool):
  """The conversion of a traced value (inside jax.jit, grad or vmap).

  As JAX's: inside a trace every value is already global, so the conversion
  is the identity (on the way in over a mesh of Auto axes, constrained to
  the global sharding). That is
  only meaningful where the local and the global shapes are equal (one
  process, or dimensions replicated across processes).
  """
  scales = layout.scales(x.ndim)
  if any(b != s for b, s in scales):
    name = ('host_local_array_to_global_array' if to_global
            else 'global_array_to_host_local_array')
    raise ValueError(
        f'{failures.prefix()} {name}: inside jax.jit (a traced value of '
        f'shape {x.shape}) the spec {layout.spec} would change the shape '
        f'(mesh {dict(layout.mesh.shape)} spans processes along it), which '
        'a trace cannot do. Convert outside jax.jit: pass global arrays to '
        'the jitted function.')
  if not to_global or jax.sharding.AxisType.Explicit in layout.mesh.axis_types:
    # Explicit axes: the value's type carries its sharding; a constraint
    # would need a mesh context that JAX's identity does not need.
    return x
  return jax.lax.with_sharding_constraint(x, layout.global_sharding)
