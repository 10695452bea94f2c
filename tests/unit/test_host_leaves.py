"""`leaves.host_leaves`, a collective's description of its tree: cached per layout for numpy leaves, always what the uncached path gives."""

from __future__ import annotations

import numpy as np

from multihost._src.runtime import leaves


def _uncached(tree):
  flat, paths, treedef = leaves.flatten(tree, 'test')
  values, specs = leaves.to_host_all(flat, 'test')
  return values, specs, tuple(paths), leaves.signature(treedef)


def test_a_cached_description_is_the_uncached_one():
  tree = {'w': np.ones((2, 3), np.float32), 'b': [np.arange(4, dtype=np.int32)]}
  first = leaves.host_leaves(tree, 'test')
  again = leaves.host_leaves(tree, 'test')  # (from the cache)
  values, specs, paths, signature = _uncached(tree)
  for got in (first, again):
    assert got.specs == specs
    assert got.paths == paths
    assert got.signature == signature
    assert got.global_paths == []
    assert all(v is x for v, x in zip(got.values, values, strict=True))


def test_leaves_that_need_converting_are_converted_on_every_call():
  # A contiguous float32 leaf first, so that its layout is cached; then one
  # of the same shape and dtype that is not contiguous, and a float64 one
  # (JAX's canonical dtype is float32 without x64).
  leaves.host_leaves(np.zeros((2, 3), np.float32), 'test')
  strided = np.arange(6, dtype=np.float32).reshape(3, 2).T
  wide = np.arange(6, dtype=np.float64).reshape(2, 3)
  for x in (strided, wide, strided, wide):
    got = leaves.host_leaves(x, 'test')
    (value,) = got.values
    assert value.flags.c_contiguous
    assert value.dtype == np.float32
    assert got.specs[0].dtype == 'float32'
    np.testing.assert_array_equal(value, x.astype(np.float32))


def test_the_cache_stays_bounded():
  for n in range(3 * leaves._LAYOUTS_MAX):  # pylint: disable=protected-access
    leaves.host_leaves(np.zeros(n + 1, np.float32), 'test')
  assert len(leaves._LAYOUTS) <= leaves._LAYOUTS_MAX  # pylint: disable=protected-access
