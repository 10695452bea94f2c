"""The leaves a training state holds, as Orbax stores them, and back.

A fresh run accepts any pytree: global `jax.Array`s, arrays on one process's
devices (committed or not), typed PRNG keys, NumPy arrays and scalars, Python
`int`/`float`/`bool`/`complex`, `None` and empty subtrees, inside dicts,
lists, tuples, namedtuples, dataclasses and custom pytree nodes. Orbax stores
global arrays and NumPy arrays. `storable` turns a tree into that form: a
nested dict of leaves keyed by their path components (`{'user': {'params':
{'w': ...}}}`), and `rebuild` turns a restored one back into the kinds of a
target tree (the fresh run's), leaf by leaf, in the target's treedef:

  target leaf                           stored as        restored as
  jax.Array, not fully addressable      the jax.Array    onto its sharding
  jax.Array, committed, one process     the jax.Array    onto its sharding
  jax.Array, uncommitted                NumPy (global    uncommitted, on its
                                        value)           device
  jax.Array, committed, fully           NumPy (global    on its (local)
    addressable, several processes      value)           sharding, committed
  typed PRNG key array                  its key_data, as above; re-wrapped
                                        with the target's implementation
  NumPy array / NumPy scalar            NumPy            NumPy, target dtype
  Python bool / int / float / complex   NumPy 0-d        the Python type

A host-local array that every process holds identically (the consistency
check before every save proves it) is stored once, as a replicated value,
and comes back on each process on its own device(s).
"""

from __future__ import annotations

from collections.abc import Iterator
import dataclasses
from typing import Any

import jax
import ml_dtypes
import numpy as np

PyTree = Any

# Python scalar types and the NumPy dtype each is stored as (bool before int:
# a bool is an int).
_PYTHON_SCALARS = ((bool, np.bool_), (int, np.int64), (float, np.float64),
                   (complex, np.complex128))
# The stored 0-d dtype kinds a Python scalar target accepts: a fresh run's
# `step=0` becomes an int32 array after its first jitted step (flax's
# TrainState), and the restore gives it back as the target's Python int.
_SCALAR_ACCEPTS = {bool: 'b', int: 'iu', float: 'f', complex: 'fc'}


def path_name(path) -> str:
  """'user/weights' for a key path such as (DictKey('user'), ...)."""
  return '/'.join(_components(path))


def _components(path) -> tuple[str, ...]:
  parts = []
  for k in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return tuple(parts)


def is_key(x) -> bool:
  """Whether `x` is a typed PRNG key array (`jax.random.key`)."""
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key)


def is_split_across_processes(x: Any) -> bool:
  """Whether `x` is a global array whose parts live on different processes.

  Its digest combines every process's shards (a collective), and parts held
  by several processes may need comparing shard by shard.
  """
  return (isinstance(x, jax.Array) and not x.is_fully_addressable
          and not x.is_fully_replicated)


def _stored_as_array(x: jax.Array) -> bool:
  """Whether a (non-key) jax.Array is stored as itself, not as NumPy."""
  if not x.is_fully_addressable:
    return True
  return jax.process_count() == 1 and x.committed


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One leaf of a tree: its path and value."""
  path: tuple[str, ...]
  value: Any

  @property
  def name(self) -> str:
    return '/'.join(self.path)


def leaves(tree: PyTree) -> tuple[list[Leaf], Any]:
  """The tree's leaves with their path components, and its treedef.

  Raises:
    TypeError: two leaves have the same path name (e.g. dict keys 0 and '0').
  """
  with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  out = [Leaf(_components(p), x) for p, x in with_path]
  seen: dict[tuple[str, ...], Any] = {}
  for (p, _), leaf in zip(with_path, out, strict=True):
    if leaf.path in seen:
      raise TypeError(
          f'Two leaves of the state have the same checkpoint name '
          f'{leaf.name!r}: {jax.tree_util.keystr(seen[leaf.path])} and '
          f'{jax.tree_util.keystr(p)}. Use distinct keys (e.g. not both 0 and '
          '\'0\' in one dict).')
    seen[leaf.path] = p
  return out, treedef


def _nest(pairs: Iterator[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
  """{('a', 'b'): x} -> {'a': {'b': x}}; a leaf's path must not be another's.

  A tree that is a single leaf (path ()) stays that leaf.
  """
  listed = list(pairs)
  if len(listed) == 1 and not listed[0][0]:
    return listed[0][1]
  out: dict[str, Any] = {}
  for path, value in listed:
    node = out
    for i, part in enumerate(path[:-1]):
      node = node.setdefault(part, {})
      if not isinstance(node, dict):
        raise TypeError(
            f'The checkpoint name {"/".join(path[:i + 1])!r} is both a leaf '
            f'and a subtree (of {"/".join(path)!r}). Use distinct keys.')
    if path[-1] in node:
      raise TypeError(
          f'The checkpoint name {"/".join(path)!r} is both a leaf and a '
          'subtree. Use distinct keys.')
    node[path[-1]] = value
  return out


def _unsupported(name: str, x: Any) -> TypeError:
  return TypeError(
      f'State leaf {name or "<root>"} is a {type(x).__module__}.'
      f'{type(x).__qualname__}, which cannot be checkpointed. A state may '
      'hold jax.Arrays (including typed PRNG keys), NumPy arrays and scalars, '
      'Python bool/int/float/complex and None, in any pytree; make this field '
      'static (e.g. flax.struct.field(pytree_node=False)) or convert it to an '
      'array.')


# What a NumPy leaf's dtype may be (said in the error for any other).
STORABLE_DTYPES = (
    'A checkpoint holds arrays of bool, integers (int2 to int64, uint2 to '
    'uint64), floats (the float4 and float8 variants, bfloat16, float16 to '
    'float64) and complex64/complex128, as jax.Arrays or NumPy (ml_dtypes) '
    'arrays; convert the leaf to one of these (e.g. x.astype(np.int64)) or '
    'make it a static field.')


def is_ml_dtype(dtype: np.dtype) -> bool:
  """Whether `dtype` is an ml_dtypes type (bfloat16, float8_*, int4, ...).

  NumPy sees most of them as dtype kind 'V', like raw bytes, and spells
  them so ('<V2' for bfloat16): their scalar type tells them apart.
  """
  return dtype.type.__module__.split('.')[0] == 'ml_dtypes'


def dtype_problem(dtype: np.dtype) -> str | None:
  """Why a NumPy array of `dtype` cannot be checkpointed, or None when it can.

  Every ml_dtypes type can (`is_ml_dtype`).
  """
  kind = dtype.kind
  if kind in 'biu':
    return None
  if kind in 'fc':  # float96/float128 and complex256 are beyond JAX's.
    if dtype.itemsize <= (8 if kind == 'f' else 16):
      return None
    return f'extended precision, {dtype.itemsize * 8} bits'
  if is_ml_dtype(dtype):
    return None
  return {'O': 'Python objects', 'U': 'text', 'S': 'byte strings',
          'M': 'dates', 'm': 'durations',
          'V': 'records' if dtype.names else 'raw bytes'}.get(kind, 'no number')


def storable_leaf(name: str, x: Any) -> jax.Array | np.ndarray:
  """One leaf as Orbax stores it: a stored jax.Array or a NumPy array.

  Local, never a collective: an uncommitted array, or one on this process's
  devices while several processes run, is read to the host; other arrays
  are kept as they are.

  Raises:
    TypeError: the leaf's type cannot be checkpointed (named with `name`).
  """
  if isinstance(x, jax.core.Tracer):
    raise TypeError(
        f'State leaf {name} is a JAX tracer: checkpoints are taken outside '
        'jit (pass concrete arrays, not values inside a traced function).')
  if isinstance(x, jax.Array):
    if is_key(x):
      x = jax.random.key_data(x)
    return x if _stored_as_array(x) else np.asarray(x)
  if isinstance(x, (np.ndarray, np.generic)):
    value = np.asarray(x)
    problem = dtype_problem(value.dtype)
    if problem is not None:
      raise TypeError(
          f'State leaf {name or "<root>"} is a {type(x).__module__}.'
          f'{type(x).__qualname__} of dtype {value.dtype} ({problem}), which '
          f'cannot be checkpointed. {STORABLE_DTYPES}')
    return value
  for python_type, dtype in _PYTHON_SCALARS:
    if isinstance(x, python_type):
      try:
        return np.asarray(x, dtype)
      except OverflowError:
        raise TypeError(
            f'State leaf {name} is the Python int {x}, which does not fit the '
            'int64 it is stored as. Keep it as a NumPy or Python value within '
            'int64, or split it.') from None
  raise _unsupported(name, x)


def storable(tree: PyTree) -> dict[str, Any]:
  """The tree as Orbax stores it: nested dicts of jax.Arrays and NumPy arrays.

  Idempotent (a storable tree is its own storable form). Local, never a
  collective (see `storable_leaf`).

  Raises:
    TypeError: a leaf cannot be checkpointed, naming its path and type.
  """
  flat, _ = leaves(tree)
  return _nest((leaf.path, storable_leaf(leaf.name, leaf.value))
               for leaf in flat)


def spec(x: jax.Array | np.ndarray | jax.ShapeDtypeStruct) -> list:
  """[shape, dtype name] of a storable (or abstract) leaf, as stored in meta."""
  return [list(x.shape), np.dtype(x.dtype).name]


def spec_dtype(spec: list) -> np.dtype:
  """The dtype a `spec` names ('bfloat16', 'float32', 'int4', ...)."""
  return np.dtype(jax.numpy.dtype(spec[1]))


def kind(x: Any) -> str:
  """How a leaf is held: 'global', 'committed', 'uncommitted', 'int', ..."""
  if isinstance(x, jax.Array):
    prefix = 'key/' if is_key(x) else ''
    if not x.is_fully_addressable:
      return prefix + 'global'
    return prefix + ('committed' if x.committed else 'uncommitted')
  if isinstance(x, np.generic):
    return 'numpy-scalar'
  if isinstance(x, np.ndarray):
    return 'numpy'
  return type(x).__name__


def _python_scalar_type(x: Any) -> type | None:
  for python_type, _ in _PYTHON_SCALARS:
    if isinstance(x, python_type) and not isinstance(x, np.generic):
      return python_type
  return None


def _abstract_leaf(name: str, x: Any, stored: list | None) -> Any:
  """What Orbax restores a target leaf's stored value into."""
  scalar = _python_scalar_type(x)
  if scalar is not None and stored is not None:
    shape, dtype = stored
    if not shape and np.dtype(dtype).kind in _SCALAR_ACCEPTS[scalar]:
      return np.zeros((), dtype)
  if isinstance(x, jax.Array):
    data = jax.random.key_data(x) if is_key(x) else x
    if _stored_as_array(data):
      return jax.ShapeDtypeStruct(data.shape, data.dtype,
                                  sharding=data.sharding)
    return np.zeros(data.shape, data.dtype)
  kept = storable_leaf(name, x)
  return np.zeros(kept.shape, kept.dtype)


def restore_target(target: PyTree,
                   stored: dict[str, list] | None = None) -> dict[str, Any]:
  """The storable tree Orbax restores into, built from `target`'s leaves.

  Arrays that are stored as arrays come back onto the target's shardings;
  everything else is read as NumPy and placed by `rebuild`. A Python scalar
  target reads the stored 0-d value in its stored dtype when `stored` (the
  checkpoint's {path: [shape, dtype]}) lists one of a compatible kind (an
  int32 array for an int, a float32 for a float).
  """
  flat, _ = leaves(target)
  stored = stored or {}
  return _nest((leaf.path, _abstract_leaf(leaf.name, leaf.value,
                                          stored.get(leaf.name)))
               for leaf in flat)


def _lookup(tree: Any, path: tuple[str, ...]) -> Any:
  for part in path:
    tree = tree[part]
  return tree


def _rebuild_leaf(name: str, target: Any, value: Any) -> Any:
  if isinstance(target, jax.Array):
    data = jax.random.key_data(target) if is_key(target) else target
    if not isinstance(value, jax.Array):
      value = np.asarray(value, data.dtype)
      if data.committed:
        value = jax.device_put(value, data.sharding)
      else:
        with jax.default_device(next(iter(data.devices()))):
          value = jax.device_put(value)
    if is_key(target):
      value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(target))
    return value
  if isinstance(target, np.ndarray):
    return np.asarray(value, target.dtype)
  if isinstance(target, np.generic):
    return np.asarray(value, target.dtype)[()]
  scalar = _python_scalar_type(target)
  if scalar is not None:
    return scalar(np.asarray(value)[()])
  raise _unsupported(name, target)


def rebuild(target: PyTree, restored: dict[str, Any]) -> PyTree:
  """The restored storable tree in `target`'s treedef and leaf kinds.

  Each leaf gets the target leaf's type, dtype, shape, sharding and
  commitment; None leaves, empty subtrees and static fields come from the
  target's treedef.
  """
  flat, treedef = leaves(target)
  return jax.tree_util.tree_unflatten(treedef, [
      _rebuild_leaf(leaf.name, leaf.value, _lookup(restored, leaf.path))
      for leaf in flat])


def dtype_text(dtype: np.dtype) -> str:
  """How a local manifest names a block's dtype: NumPy's '<f4', or the name of an ml_dtypes type ('bfloat16').

  NumPy's text of an ml_dtypes type ('<V2' for bfloat16, '<f1' for
  float8_e5m2) does not read back as that type; its name does (`dtype_of`).
  """
  if is_ml_dtype(dtype):
    return dtype.name
  return dtype.str


def dtype_of(text: str) -> np.dtype:
  """The dtype a manifest names (`dtype_text`).

  Raises:
    TypeError: no such dtype.
  """
  scalar = getattr(ml_dtypes, text, None)
  if isinstance(scalar, type) and issubclass(scalar, np.generic):
    return np.dtype(scalar)
  return np.dtype(text)
