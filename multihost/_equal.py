"""assert_equal (temporary: delegates to JAX)."""
from jax.experimental import multihost_utils as _m
def assert_equal(in_tree, fail_message='', *, timeout=None):
  del timeout
  _m.assert_equal(in_tree, fail_message)
def tree_digest(tree):
  raise NotImplementedError
