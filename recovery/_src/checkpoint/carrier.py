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

A jax.Array is converted shard by shard on the host (its shards are read
and put back on their devices): no collective, no gather, no XLA op.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import ml_dtypes
import numpy as np
import tensorstore


@functools.cache
def carrier(dtype: np.dtype) -> np.dtype | None:
  """The dtype Orbax stores `dtype` in, or None when it stores `dtype` itself.

  Raises:
    TypeError: TensorStore cannot store `dtype` and no carrier holds its
      bits (named, with the fix).
  """
  dtype = np.dtype(dtype)
  try:
    tensorstore.dtype(dtype.name)
    return None
  except (TypeError, ValueError):
    pass
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


def encode_abstract(abstract: Any) -> Any:
  """The restore target Orbax reads into: each leaf's carrier in its place."""
  def leaf(x):
    into = carrier(np.dtype(x.dtype))
    if into is None:
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, into, sharding=x.sharding)
    return np.zeros(np.shape(x), into)
  return jax.tree.map(leaf, abstract)


def decode(restored: Any, abstract: Any) -> Any:
  """The tree Orbax restored, each carried leaf back in `abstract`'s dtype."""
  def leaf(x, like):
    dtype = np.dtype(like.dtype)
    return x if carrier(dtype) is None else _to(x, dtype)
  return jax.tree.map(leaf, restored, abstract)
