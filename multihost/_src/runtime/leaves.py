"""Runtime: leaves of a pytree as host bytes (normalization, description, packing); pure.

A leaf of a collective is a numpy array, a `jax.Array` (including typed PRNG
key arrays) or a Python scalar. Host-side it becomes a C-contiguous numpy array
whose dtype is what JAX would give it on a device (`canonicalize_dtype`); key
arrays travel as their `key_data` and are re-wrapped with the same
implementation on the way out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any
from typing import NamedTuple

import jax
import numpy as np

PyTree = Any


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """What every process must agree on about a leaf."""
  shape: tuple[int, ...]
  dtype: str  # numpy dtype name; for keys the key_data dtype
  key_impl: str | None = None  # the PRNG implementation of a typed key leaf
  key_dims: int = 0  # trailing dims of `shape` that belong to each key

  def fields(self) -> tuple:
    """The fields as a plain tuple (cheap to print, for agreement digests)."""
    return (self.shape, self.dtype, self.key_impl, self.key_dims)

  @property
  def ndim(self) -> int:
    """The leaf's own ndim (for keys: without the key data dims)."""
    return len(self.shape) - self.key_dims

  def describe(self) -> str:
    kind = f'key<{self.key_impl}>' if self.key_impl else self.dtype
    return f'{kind}{list(self.shape)}'

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * np_dtype(self.dtype).itemsize


def require_not_tracer(x, op: str) -> None:
  """Raises TypeError for a tracer: the collectives are host-side, eager."""
  if isinstance(x, jax.core.Tracer):
    raise TypeError(
        f'{op} is a host-side collective and cannot run inside jax.jit, '
        'vmap or grad (it got a tracer). Call it outside transformed code.')


def is_key(x) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key)


def is_global(x) -> bool:
  """A jax.Array whose shards are not all on this process."""
  return isinstance(x, jax.Array) and not x.is_fully_addressable


def to_host(x, op: str, *, canonical: bool = True
            ) -> tuple[np.ndarray, LeafSpec]:
  """A fully addressable leaf as a C-contiguous numpy array (JAX's canonical dtype by default) and its spec.

  With canonical=False the array keeps its own dtype (a NumPy float64 stays
  float64 with jax_enable_x64 off): what a digest of every bit reads.
  """
  key_impl, key_dims = None, 0
  if isinstance(x, np.ndarray):  # The common case, kept cheap.
    value = x
  else:
    require_not_tracer(x, op)
    if is_key(x):
      key_impl = str(jax.random.key_impl(x))
      data = jax.random.key_data(x)
      key_dims = data.ndim - x.ndim
      x = data
    if is_global(x):
      raise ValueError(f'{op}: internal error, a global array reached '
                       'to_host.')
    value = np.asarray(x)
  # JAX's options are attributes it makes at run time (so not typed).
  dtype = (_canonical(value.dtype,
                      jax.config.jax_enable_x64)  # type: ignore[attr-defined]
           if canonical else value.dtype)
  if value.dtype != dtype:
    value = value.astype(dtype)
  if not value.flags.c_contiguous:  # (np.ascontiguousarray makes 0-d 1-d.)
    value = value.copy(order='C')
  return value, LeafSpec(value.shape, dtype_name(dtype), key_impl, key_dims)


def to_host_all(leaves: list, op: str
                ) -> tuple[list[np.ndarray], tuple[LeafSpec, ...]]:
  """`to_host` of every leaf: (values, specs)."""
  values, specs = [], []
  for x in leaves:
    value, spec = to_host(x, op)
    values.append(value)
    specs.append(spec)
  return values, tuple(specs)


def global_paths(leaves: list, paths: list[str]) -> list[str]:
  """The paths of the leaves that are global (not fully addressable) arrays."""
  return [p for p, x in zip(paths, leaves, strict=True) if is_global(x)]


@functools.cache
def _canonical(dtype: np.dtype, x64: bool) -> np.dtype:
  """The dtype a JAX device would give `dtype` (e.g. float64 -> float32).

  Cached per x64 setting (`x64` is part of the key), so turning
  `jax_enable_x64` on or off between calls takes effect.
  """
  del x64  # Only a cache key: canonicalize_dtype reads the setting itself.
  return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def distinct_shards(x: jax.Array, op: str, *, canonical: bool = True):
  """Yields (bounds, host value, spec) of each distinct addressable shard.

  `bounds` is a tuple of (start, stop) per dimension of the global array;
  replicas of a shard already yielded are skipped. `canonical` as `to_host`'s.
  """
  seen = set()
  for shard in x.addressable_shards:
    # (A key array's shard index may also cover its key data's axes.)
    bounds = tuple(s.indices(n)[:2]
                   for s, n in zip(shard.index[:x.ndim], x.shape, strict=True))
    if bounds not in seen:
      seen.add(bounds)
      yield (bounds, *to_host(shard.data, op, canonical=canonical))


@functools.cache
def np_dtype(name: str) -> np.dtype:
  """The numpy dtype for a dtype name, including ml_dtypes' (bfloat16)."""
  return np.dtype(jax.numpy.dtype(name))


@functools.cache
def dtype_name(dtype: np.dtype) -> str:
  return np.dtype(dtype).name


def finish(value: np.ndarray, spec: LeafSpec):
  """Wraps key data back into a typed key array; other leaves stay numpy."""
  if spec.key_impl is None:
    return value
  # It takes any array (a copy of numpy's here); its annotation says Array.
  return jax.random.wrap_key_data(
      np.array(value), impl=spec.key_impl)  # type: ignore[arg-type]


def pack(values: list[np.ndarray], pad_to: int = 0, *,
         copy: bool = True) -> np.ndarray:
  """Concatenates the raw bytes of `values` into one uint8 array.

  With `pad_to`, the array is zero-padded to at least that many bytes (so a
  device transfer can use it without another copy). With copy=False, a
  single value is returned as a byte view of itself (read it, don't keep it).
  """
  total = sum(v.nbytes for v in values)
  if not copy and len(values) == 1 and pad_to <= total:
    return values[0].reshape(-1).view(np.uint8)
  out = np.empty(max(total, pad_to), np.uint8)
  out[total:] = 0
  pack_into(out, values)
  return out


def pack_into(out: np.ndarray, values: list[np.ndarray]) -> None:
  """Writes the raw bytes of `values`, one after another, into uint8 `out` (at least as long)."""
  offset = 0
  for v in values:
    n = v.nbytes
    if n:
      out[offset:offset + n] = v.reshape(-1).view(np.uint8)
    offset += n


def packed_bytes(values: list[np.ndarray]) -> bytes:
  """`pack(values)` as bytes, without the array in between (a small payload that travels in a header)."""
  if len(values) == 1:
    return values[0].tobytes()
  return b''.join([v.reshape(-1).view(np.uint8).data for v in values])


def unpack(buffer: np.ndarray, specs: list[LeafSpec],
           shapes: list[tuple[int, ...]] | None = None) -> list:
  """Splits `buffer` back into leaves (optionally with other shapes)."""
  if len(specs) == 1 and shapes is None and specs[0].nbytes == len(buffer):
    spec = specs[0]  # One leaf, the whole buffer (no slice).
    return [buffer.view(np_dtype(spec.dtype)).reshape(spec.shape)]
  leaves = []
  offset = 0
  for i, spec in enumerate(specs):
    shape = spec.shape if shapes is None else shapes[i]
    dtype = np_dtype(spec.dtype)
    n = math.prod(shape) * dtype.itemsize
    value = buffer[offset:offset + n].view(dtype).reshape(shape)
    offset += n
    leaves.append(value)
  return leaves


def rebuild(buffer: np.ndarray, specs: tuple[LeafSpec, ...],
            treedef) -> PyTree:
  """The tree of the leaves packed in `buffer` (views of it; keys re-wrapped)."""
  leaves = unpack(buffer, list(specs))
  return treedef.unflatten([finish(v, s)
                            for v, s in zip(leaves, specs, strict=True)])


def stacked_views(rows: np.ndarray, specs, *, tiled: bool) -> list:
  """Leaves gathered from equal-layout rows, as views of `rows` (no copy).

  Row p holds process p's packed leaves, all at the same offsets, so a
  leaf's stacked value is a column band of `rows` viewed as its dtype. With
  a single leaf whose size is the row's, it is contiguous.
  """
  count = rows.shape[0]
  out, offset = [], 0
  for spec in specs:
    n = spec.nbytes
    band = rows[:, offset:offset + n]
    offset += n
    value = band.view(np_dtype(spec.dtype)).reshape(
        (count,) + spec.shape)
    if tiled and spec.ndim > 0:
      value = value.reshape((count * spec.shape[0],) + spec.shape[1:])
    out.append(finish(value, spec))
  return out


# Static fields of custom nodes (a flax TrainState's apply_fn and tx, an nnx
# GraphDef) print with their memory address, which differs between processes.
_ADDRESS = re.compile(r' at 0x[0-9a-fA-F]+')


def signature(treedef) -> str:
  """The tree structure as text that is the same on every process (no memory addresses)."""
  known = _known(treedef)
  return known[1] if known else _ADDRESS.sub('', str(treedef))


def flatten(tree: PyTree, op: str):
  """Leaves with their key paths (as strings) and the treedef.

  Raises:
    TypeError: a leaf is a tracer (the collectives are host-side).
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  for leaf in leaves:
    require_not_tracer(leaf, op)
  known = _known(treedef)
  if known is None:
    with_path = jax.tree_util.tree_flatten_with_path(tree)[0]
    known = (tuple(jax.tree_util.keystr(p) or '<root>' for p, _ in with_path),
             _ADDRESS.sub('', str(treedef)))
    _remember(_TREEDEFS, treedef, known)
  return leaves, list(known[0]), treedef


class HostLeaves(NamedTuple):
  """A pytree's leaves on the host (`host_leaves`): what a collective sends and agrees on.

  (A named tuple: made on every call, it costs a tenth of a frozen
  dataclass's six field settings.)
  """
  values: list  # C-contiguous numpy arrays of canonical dtypes
  specs: tuple[LeafSpec, ...]
  paths: tuple[str, ...]
  signature: str  # `signature(treedef)`
  treedef: Any
  global_paths: list[str]  # leaves that are global arrays (then no values)


def host_leaves(tree: PyTree, op: str) -> HostLeaves:
  """`flatten`, `global_paths`, `to_host_all` and `signature` of `tree` in one.

  A tree of plain numpy arrays, already C-contiguous and of canonical
  dtypes, as a training loop passes each step, costs one flatten and one
  lookup: its paths, signature and specs are cached per tree structure,
  shapes and dtypes (bounded, as `_TREEDEFS`). `values` are then the
  leaves themselves. With global leaves, `values` and `specs` are empty.

  Raises:
    TypeError: a leaf is a tracer (the collectives are host-side).
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  key = None
  if all(type(x) is np.ndarray for x in leaves):
    x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]  # (as above)
    key = (treedef, x64, *[(x.shape, x.dtype, x.flags.c_contiguous)
                            for x in leaves])
    known = _cached(_LAYOUTS, key)
    if known is not None:
      specs, paths, signature_ = known
      return HostLeaves(leaves, specs, paths, signature_, treedef, [])
  leaves, paths, treedef = flatten(tree, op)
  bad = global_paths(leaves, paths)
  values, specs = ([], ()) if bad else to_host_all(leaves, op)
  described = HostLeaves(values, specs, tuple(paths), signature(treedef),
                         treedef, bad)
  if (not bad and key is not None
      and all(v is x for v, x in zip(values, leaves, strict=True))):
    _remember(_LAYOUTS, key, (specs, described.paths, described.signature))
  return described


# `host_leaves`' cache: per tree structure, x64 setting and each leaf's
# (shape, dtype, contiguity), the specs, paths and signature of a tree of
# numpy leaves that need no conversion. Bounded: cleared when full.
_LAYOUTS: dict[tuple, tuple[tuple[LeafSpec, ...], tuple[str, ...], str]] = {}
_LAYOUTS_MAX = _CACHE_MAX = 256  # Entries of each cache here, at most.


# Each flattened treedef's (leaf paths, signature), which a training loop's
# collectives need every step (so it is cached, off the fast path's cost).
# Bounded; treedefs whose static data cannot be hashed are not kept.
_TREEDEFS: dict[Any, tuple[tuple[str, ...], str]] = {}


def _known(treedef) -> tuple[tuple[str, ...], str] | None:
  return _cached(_TREEDEFS, treedef)


def _cached(cache: dict, key):
  """`cache[key]`, or None when absent or when `key` cannot be hashed (static data)."""
  try:
    return cache.get(key)
  except TypeError:
    return None


def _remember(cache: dict, key, value) -> None:
  """Keeps `value` under `key` in a bounded `cache` (cleared when full); an unhashable key is not kept."""
  if len(cache) >= _CACHE_MAX:
    cache.clear()
  try:
    cache[key] = value
  except TypeError:
    pass


def first_difference(specs_by_process: dict[int, tuple]) -> str:
  """Describes how (treedef, paths, specs) tuples differ between processes."""
  items = sorted(specs_by_process.items())
  base_p, (base_tree, base_paths, base_specs) = items[0]
  for p, (tree, _, specs) in items[1:]:
    if tree != base_tree:
      return (f'the tree structure differs: process {base_p} has {base_tree}'
              f' but process {p} has {tree}')
    for path, a, b in zip(base_paths, base_specs, specs, strict=True):
      if a != b:
        return (f'leaf {path} differs: process {base_p} has {a.describe()} '
                f'but process {p} has {b.describe()}')
  return 'no difference found'
