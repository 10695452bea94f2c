"""Dtypes Orbax's TensorStore cannot store, carried in dtypes it can.

TensorStore (under Orbax) stores bfloat16, float16, most float8 variants,
float4_e2m1fn, int2 and int4, but not every dtype JAX has: in the installed
version uint2, uint4 and float8_e4m3 are refused at the save. Such a leaf is
written in a carrier of one byte an item and read back into its own dtype,
the same bits: an integer type by value (uint4 in uint8, every value
exact), a float type bit for bit (float8_e4m3 as uint8). The checkpoint's
meta item (its `leaves` specs and digests) names and digests the leaf's own
dtype and value, never the carrier's, so the digest check is unchanged and
the local tier (which writes raw bytes) needs no carrier.

Which leaves went in a carrier is decided at the save and recorded there:
the meta item's `storage` ({path: the dtype Orbax wrote}, `storage`), and a
restore reads each leaf as recorded, whatever TensorStore is installed when
it runs (one that stores float8_e4m3 natively reads a carried leaf as the
uint8 it is). A checkpoint without the record (written before it existed)
is read by today's rule (`carrier`).

A jax.Array is converted shard by shard on the host (its shards are read
and put back on their devices): no collective, no gather, no XLA op.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

import jax
import ml_dtypes
import numpy as np
import tensorstore

from recovery._src.state import leaves


@functools.cache
def stores_natively(dtype: np.dtype) -> bool:
  """Whether the installed TensorStore stores `dtype` itself."""
  try:
    tensorstore.dtype(np.dtype(dtype).name)
    return True
  except (TypeError, ValueError):
    return False


def carrier(dtype: np.dtype) -> np.dtype | None:
  """The dtype a save now stores `dtype` in, or None when it stores `dtype` itself.

  Raises:
    TypeError: TensorStore cannot store `dtype` and no carrier holds its
      bits (named, with the fix).
  """
  dtype = np.dtype(dtype)
  if stores_natively(dtype):
    return None
  try:
    info = ml_dtypes.iinfo(dtype)
    if info.bits <= 8:
      return np.dtype(np.int8 if info.min < 0 else np.uint8)
  except ValueError:
    pass
  try:
    if ml_dtypes.finfo(dtype).bits == 8 * dtype.itemsize:
      return np.dtype(f'u{dtype.itemsize}')
  except ValueError:
    pass
  raise TypeError(
      f'dtype {dtype.name} cannot be stored by Orbax\'s TensorStore (version '
      'installed here) and has no carrier that keeps its bits; convert the '
      'leaf to a dtype TensorStore stores (e.g. float32) before saving.')


def _version() -> str:
  try:
    return importlib.metadata.version('tensorstore')
  except importlib.metadata.PackageNotFoundError:
    return 'unknown'


def _convert_host(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """`value` in `dtype`: integers by value, floats bit for bit."""
  if _by_value(value.dtype, dtype):
    return value.astype(dtype)
  return value.view(dtype)


def _by_value(a: np.dtype, b: np.dtype) -> bool:
  """Whether a conversion between `a` and `b` goes by value (integers)."""
  return not (_is_float(a) or _is_float(b))


def _is_float(dtype: np.dtype) -> bool:
  try:
    ml_dtypes.finfo(dtype)
    return True
  except ValueError:
    return False


def _convert_device(x: jax.Array, dtype: np.dtype) -> jax.Array:
  """A jax.Array in `dtype`: each shard read, converted on the host, put back on its device.

  Not by an XLA op: on a TPU v5e chip (JAX 0.10.2), bitcasting a
  float8_e4m3 array to uint8 changed some items' bits (the digest check
  caught it); a host view keeps them, and so does a device_put. The
  result keeps `x`'s sharding exactly, also on one device.
  """
  return jax.make_array_from_single_device_arrays(
      x.shape, x.sharding,
      [jax.device_put(_convert_host(np.asarray(s.data), dtype), s.device)
       for s in x.addressable_shards])


def _to(x: Any, dtype: np.dtype) -> Any:
  if isinstance(x, jax.Array):
    return _convert_device(x, dtype)
  return _convert_host(np.asarray(x), dtype)


def encode(tree: Any) -> Any:
  """The storable tree as Orbax saves it: each leaf in its carrier, if any.

  Raises:
    TypeError: a leaf's dtype cannot be stored (see `carrier`).
  """
  def leaf(x):
    into = carrier(np.dtype(x.dtype))
    return x if into is None else _to(x, into)
  return jax.tree.map(leaf, tree)


def storage(tree: Any) -> dict[str, str]:
  """{path: the dtype Orbax writes} of a storable tree, for the meta item (each leaf's own dtype where it goes uncarried)."""
  def stored(x):
    into = carrier(np.dtype(x.dtype))
    return (np.dtype(x.dtype) if into is None else into).name
  return {leaves.path_name(path): stored(x) for path, x in
          jax.tree_util.tree_flatten_with_path(tree)[0]}


def _carried_in(path: Any, dtype: np.dtype,
                recorded: dict[str, str] | None) -> np.dtype | None:
  """The carrier leaf `path` of `dtype` was saved in (None: none), as `recorded` at the save; by today's rule where nothing was recorded."""
  if recorded is None or leaves.path_name(path) not in recorded:
    return carrier(dtype)
  name = leaves.path_name(path)
  into = np.dtype(leaves.dtype_of(recorded[name]))
  if not stores_natively(into):
    raise TypeError(
        f'leaf {name} was saved as {into.name} by a TensorStore that stores '
        f'{into.name}; the TensorStore installed here (version '
        f'{_version()}) does not read it. Restore with the TensorStore '
        'version that saved it (or a newer one).')
  return None if into == dtype else into


def encode_abstract(abstract: Any,
                    recorded: dict[str, str] | None = None) -> Any:
  """The restore target Orbax reads into: each leaf's carrier in its place, as `recorded` at the save (the meta item's `storage`).

  Raises:
    TypeError: a leaf was saved in a dtype the installed TensorStore does
      not read (named, with the fix).
  """
  def leaf(path, x):
    into = _carried_in(path, np.dtype(x.dtype), recorded)
    if into is None:
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, into, sharding=x.sharding)
    return np.zeros(np.shape(x), into)
  return jax.tree_util.tree_map_with_path(leaf, abstract)


def decode(restored: Any, abstract: Any,
           recorded: dict[str, str] | None = None) -> Any:
  """The tree Orbax restored, each carried leaf (as `recorded` at the save) back in `abstract`'s dtype."""
  def leaf(path, x, like):
    dtype = np.dtype(like.dtype)
    return x if _carried_in(path, dtype, recorded) is None else _to(x, dtype)
  return jax.tree_util.tree_map_with_path(leaf, restored, abstract)
