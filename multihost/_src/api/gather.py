"""Public collectives: process_allgather and allgather_object."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from multihost._src.api import objects
from multihost._src.control import agree
from multihost._src.diagnostics import metrics
from multihost._src.runtime import leaves as _leaves
from multihost._src.runtime import process as _process
from multihost._src.transport import choice

PyTree = Any

# With the device transport, all-gathers whose total (per-process payload x
# processes) is at most this travel through the coordination service; larger
# ones, and all of them over TCP, through the data plane.
_INLINE_TOTAL = 4 * agree.INLINE_BYTES


@metrics.recorded('process_allgather', metrics.result_bytes)
def process_allgather(in_tree: PyTree, tiled: bool = False, *,
                      timeout: float | None = None) -> PyTree:
  """Gathers `in_tree` from every process; returns numpy arrays.

  Collective: every process must call this, in the same order.

  Drop-in for `jax.experimental.multihost_utils.process_allgather`:
  * a host-local leaf (numpy array, scalar, fully addressable jax.Array) is
    stacked along a new axis 0 (`tiled=False`, and always for 0-d leaves) or
    concatenated along axis 0 (`tiled=True`);
  * a global jax.Array that is not fully addressable comes back as its full
    global value; that needs `tiled=True` (there is no per-process axis to
    stack along), `tiled=False` raises ValueError.
  Typed PRNG key leaves come back as key arrays. One process gives the same
  shapes as many. The whole tree moves as one packed transfer, after the
  processes agree on its structure, shapes and dtypes.

  Args:
    in_tree: pytree of arrays and scalars; same structure, shapes and dtypes
      on every process.
    tiled: concatenate instead of stacking.
    timeout: seconds to wait for every process.

  Returns:
    A pytree of numpy arrays with the gathered values.

  Raises:
    ValueError: a non-fully-addressable array with tiled=False.
    ConsistencyError: the processes passed different trees, shapes or dtypes.
    CollectiveTimeoutError: a process did not arrive in time (named).
  """
  op = 'process_allgather'
  timeout = _process.resolve_timeout(timeout)
  tree = _leaves.host_leaves(in_tree, op)
  paths, treedef = tree.paths, tree.treedef
  has_global = bool(tree.global_paths)
  if not has_global:  # The common case: one call converts every leaf.
    parts, specs = tree.values, tree.specs
    shards: list[list | None] = [None] * len(paths)  # this process's bounds
    layouts: list[list | None] = [None] * len(paths)  # every process's
  else:
    parts, specs, shards, layouts = _with_global_leaves(
        jax.tree_util.tree_leaves(in_tree), list(paths), op, tiled)
  count = _process.process_count()
  if count == 1:
    out = [_assemble(parts_of_leaf, spec, tiled, bounds)
           for parts_of_leaf, spec, bounds in _by_leaf([parts], specs, [shards])]
    return treedef.unflatten(out)
  size = sum(p.nbytes for p in parts)
  # What every process sends follows from the specs and the global leaves'
  # layouts, which the agreement covers, so every process knows every size.
  sizes = ([size] * count if not has_global else
           [_size_of(specs, layouts, p) for p in range(count)])
  inline = (max(sizes) * count <= _INLINE_TOTAL
            and not choice.carries_small_payloads())
  header = agree.Header(
      op, tree.signature, paths, tuple(specs), size=size,
      payload=_leaves.packed_bytes(parts) if inline else None,
      tiled=bool(tiled), layouts=tuple(layouts), shards=tuple(shards))
  if inline:
    payloads, headers = agree.agree_and_gather(header,
                                                        timeout=timeout)
  else:
    payloads, headers = None, agree.agree(
        header, timeout=timeout).headers
  if headers is None:
    if not inline:
      rows = choice.allgather(_leaves.pack(parts, copy=False), sizes,
                                   op=op, timeout=timeout)
    if not has_global:
      if inline:  # Equal sizes: the rows, joined in one (writable) copy.
        rows = np.frombuffer(bytearray().join(agree.shared(payloads, op)),
                             np.uint8).reshape(count, size)
      return treedef.unflatten(_leaves.stacked_views(rows, specs,
                                                     tiled=tiled))
    received = ([np.frombuffer(p, np.uint8)
                 for p in agree.shared(payloads, op)] if inline
                else [rows[p, :n] for p, n in enumerate(sizes)])
    all_shards = [[None if layout is None else layout[p]
                   for layout in layouts] for p in range(count)]
  else:
    agree.check_same_leaves(headers)
    agree.check_same_options(headers)
    all_shards = [list(h.shards) for h in headers]
    received = _receive(headers, parts, op, timeout)
  per_process = [
      _leaves.unpack(buf, *_part_specs(specs, s))
      for buf, s in zip(received, all_shards, strict=True)]
  out = [_assemble(parts_of_leaf, spec, tiled, bounds)
         for parts_of_leaf, spec, bounds in _by_leaf(per_process, specs,
                                                     all_shards)]
  return treedef.unflatten(out)


def _receive(headers, parts, op, timeout) -> list[np.ndarray]:
  """Every process's packed bytes, from the headers or one device gather."""
  if all(h.payload is not None for h in headers):
    return [np.frombuffer(h.payload, np.uint8) for h in headers]
  sizes = [h.size for h in headers]
  rows = choice.allgather(_leaves.pack(parts, copy=False), sizes, op=op,
                               timeout=timeout)
  return [rows[p, :n] for p, n in enumerate(sizes)]


def _with_global_leaves(leaves, paths, op: str, tiled: bool):
  """(parts, specs, shards, layouts) of a tree with global leaves (see above)."""
  parts: list[np.ndarray] = []   # what this process sends, in order
  specs: list[_leaves.LeafSpec] = []
  shards: list[list | None] = []  # per leaf: this process's shard bounds
  layouts: list[list | None] = []  # per leaf: every process's shard bounds
  for path, x in zip(paths, leaves, strict=True):
    if _leaves.is_global(x):
      if not tiled:
        raise ValueError(
            # JAX's words first (code may match them), then which leaf.
            f'{op}: Gathering global non-fully-addressable arrays only '
            f'supports tiled=True: leaf {path} is a global jax.Array that is '
            f'not fully addressable (shape {x.shape}, sharding '
            f'{x.sharding}). Its '
            'processes hold parts of one value, not one value each, so it '
            'cannot be stacked: pass tiled=True to get its full global '
            'value.')
      spec, bounds, datas, layout = _global_parts(x, op)
      specs.append(spec)
      shards.append(bounds)
      layouts.append(layout)
      parts.extend(datas)
    else:
      value, spec = _leaves.to_host(x, op)
      specs.append(spec)
      shards.append(None)
      layouts.append(None)
      parts.append(value)
  return parts, tuple(specs), shards, layouts


def _global_parts(x: jax.Array, op: str):
  """Spec, shard bounds and data of this process's distinct shards of x."""
  key_impl, key_dims = None, 0
  if _leaves.is_key(x):
    key_impl = str(jax.random.key_impl(x))
    data = jax.random.key_data(x)
    key_dims = data.ndim - x.ndim
    x = data
  dtype = jax.dtypes.canonicalize_dtype(x.dtype)
  spec = _leaves.LeafSpec(tuple(x.shape), _leaves.dtype_name(dtype), key_impl,
                          key_dims)
  shards = sorted(_leaves.distinct_shards(x, op), key=lambda s: s[0])
  bounds = [b for b, _, _ in shards]
  datas = [value for _, value, _ in shards]
  # Every process's distinct shards, from the sharding alone.
  layout: list[set[tuple[tuple[int, int], ...]]] = [
      set() for _ in range(_process.process_count())]
  for device, index in x.sharding.devices_indices_map(x.shape).items():
    # jax's `Device` (jaxlib's) does not resolve for mypy (it reports an
    # unresolved `Device?`); the attribute exists on every device.
    layout[device.process_index].add(  # type: ignore[attr-defined]
        tuple(s.indices(n)[:2] for s, n in zip(index, x.shape, strict=True)))
  return spec, bounds, datas, [sorted(b) for b in layout]


def _size_of(specs, layouts, process: int) -> int:
  """Bytes `process` sends: its host-local leaves and its global shards."""
  total = 0
  for spec, layout in zip(specs, layouts, strict=True):
    if layout is None:
      total += spec.nbytes
    else:
      itemsize = _leaves.np_dtype(spec.dtype).itemsize
      total += sum(math.prod(stop - start for start, stop in b) * itemsize
                   for b in layout[process])
  return total


def _part_specs(specs, shards):
  """The (spec, shape) of every part one process sent, in order."""
  out_specs, out_shapes = [], []
  for spec, bounds in zip(specs, shards, strict=True):
    if bounds is None:
      out_specs.append(spec)
      out_shapes.append(spec.shape)
    else:
      for b in bounds:
        out_specs.append(spec)
        out_shapes.append(tuple(stop - start for start, stop in b))
  return out_specs, out_shapes


def _by_leaf(per_process, specs, all_shards):
  """Regroups each process's flat parts into [leaf][process][parts]."""
  cursors = [0] * len(per_process)
  for i, spec in enumerate(specs):
    leaf_parts = []
    for p, parts in enumerate(per_process):
      bounds = all_shards[p][i]
      n = 1 if bounds is None else len(bounds)
      leaf_parts.append(parts[cursors[p]:cursors[p] + n])
      cursors[p] += n
    yield leaf_parts, spec, [s[i] for s in all_shards]


def _assemble(parts_of_leaf, spec, tiled, bounds_by_process):
  if bounds_by_process[0] is None:
    values = [parts[0] for parts in parts_of_leaf]
    if tiled and spec.ndim > 0:
      out = np.concatenate(values, axis=0)
    else:
      out = np.stack(values, axis=0)
  else:
    out = np.empty(spec.shape, _leaves.np_dtype(spec.dtype))
    for parts, bounds in zip(parts_of_leaf, bounds_by_process, strict=True):
      for data, b in zip(parts, bounds, strict=True):
        out[tuple(slice(start, stop) for start, stop in b)] = data
  return _leaves.finish(out, spec)


@metrics.recorded('allgather_object')
def allgather_object(obj: Any, *, timeout: float | None = None) -> list[Any]:
  """Returns every process's picklable `obj`, as a list in process order.

  Collective: every process must call this, in the same order.

  Any picklable value of any size (they may differ by process): pickled,
  each up to 64 KiB travels with the call's agreement; if any is larger,
  all go in one all-gather of the data plane; sealed with the job secret
  and checked before they are unpickled. This process's own entry is `obj`
  itself.

  Args:
    obj: this process's value.
    timeout: seconds to wait for every process.

  Raises:
    CollectiveTimeoutError: a process did not arrive in time (named).
  """
  op = 'allgather_object'
  timeout = _process.resolve_timeout(timeout)
  count = _process.process_count()
  if count == 1:
    return [obj]
  data = objects.dumps(obj)
  inline = len(data) <= agree.INLINE_BYTES
  header = agree.Header(op, size=len(data),
                        payload=data if inline else None,
                        seal=objects.seal(op, data, timeout))
  # One agreement, and every process's size, seal and inline bytes (no
  # header of every process exchanged and decoded, unless they differ).
  records, headers = agree.agree_and_gather(header, timeout=timeout,
                                            publish=objects.record(header))
  if headers is None:
    objs = [objects.read_record(op, p, r)
            for p, r in enumerate(agree.shared(records, op))]
  else:
    objs = [(h.size, h.seal, h.payload) for h in headers]
  me = _process.process_index()
  for p, (size, _, _) in enumerate(objs):
    objects.check_size(op, p, size)
  payloads: list[bytes | memoryview | None]
  if all(payload is not None for _, _, payload in objs):
    payloads = [payload for _, _, payload in objs]
  else:
    sizes = [size for size, _, _ in objs]
    rows = choice.allgather(np.frombuffer(data, np.uint8), sizes, op=op,
                            timeout=timeout)
    payloads = [rows[p, :n].data for p, n in enumerate(sizes)]
  return [obj if p == me else
          objects.loads(op, p, b, objs[p][1], timeout)
          for p, b in enumerate(payloads)]
