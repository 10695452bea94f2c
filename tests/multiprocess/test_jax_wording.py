"""Where JAX's multihost_utils raises a ValueError or AssertionError with a message, ours contains JAX's words.

Code written against `jax.experimental.multihost_utils` may match JAX's
messages (its own tests do, with assertRaisesRegex). Each test here calls
JAX's module and ours with the same bad input, in the same process, and
checks that our message contains JAX's whole message (for fixed messages),
or JAX's words around the values (where the values are shown differently:
JAX's assert_equal prints the gathered arrays, ours names leaves and
processes). Our advice follows JAX's words.
"""

from __future__ import annotations

import jax
from jax.experimental import multihost_utils as jax_mhu
import numpy as np
import pytest
from topologies import topologies

import multihost

two_hosts = topologies('2x2', timeout=240)


def _messages(exception, jax_call, our_call) -> tuple[str, str]:
  with pytest.raises(exception) as theirs:
    jax_call()
  with pytest.raises(exception) as ours:
    our_call()
  return str(theirs.value), str(ours.value)


def _global_rows(mesh):
  local = np.arange(8, dtype=np.float32).reshape(4, 2)
  return multihost.host_local_array_to_global_array(
      local, mesh, jax.P(mesh.axis_names))


@two_hosts
def test_none_pspecs(topology):
  mesh = jax.make_mesh((jax.device_count(),), ('x',))
  x = np.zeros((jax.local_device_count(), 2), np.float32)
  theirs, ours = _messages(
      ValueError,
      lambda: jax_mhu.host_local_array_to_global_array(x, mesh, None),
      lambda: multihost.host_local_array_to_global_array(x, mesh, None))
  assert '`None` is not a valid input to the pspecs argument' in theirs
  assert theirs in ours, (theirs, ours)
  global_array = _global_rows(mesh)
  theirs, ours = _messages(
      ValueError,
      lambda: jax_mhu.global_array_to_host_local_array(
          global_array, mesh, None),
      lambda: multihost.global_array_to_host_local_array(
          global_array, mesh, None))
  assert theirs in ours, (theirs, ours)
  # A None leaf inside a tree of specs: JAX's words too.
  with pytest.raises(ValueError) as info:
    multihost.host_local_array_to_global_array(
        {'a': x, 'b': x}, mesh, {'a': jax.P('x'), 'b': None})
  assert theirs in str(info.value), str(info.value)


@two_hosts
def test_stacked_gather_of_a_global_array(topology):
  mesh = jax.make_mesh((jax.device_count(),), ('x',))
  global_array = _global_rows(mesh)
  assert not global_array.is_fully_addressable
  theirs, ours = _messages(
      ValueError,
      lambda: jax_mhu.process_allgather(global_array, tiled=False),
      lambda: multihost.process_allgather(global_array, tiled=False))
  assert ('Gathering global non-fully-addressable arrays only supports '
          'tiled=True') in theirs
  assert theirs in ours, (theirs, ours)


@two_hosts
def test_live_devices_arguments(topology):
  theirs, ours = _messages(ValueError,
                           lambda: _enter(jax_mhu.live_devices([])),
                           lambda: _enter(multihost.live_devices([])))
  assert theirs == 'No devices provided.'
  assert theirs in ours, (theirs, ours)
  others = [d for d in jax.devices()
            if d.process_index != jax.process_index()]
  theirs, ours = _messages(ValueError,
                           lambda: _enter(jax_mhu.live_devices(others)),
                           lambda: _enter(multihost.live_devices(others)))
  assert theirs == 'Provided devices do not have any local devices.'
  assert theirs in ours, (theirs, ours)


def _enter(block):
  with block:
    pass


@two_hosts
def test_assert_equal_and_sync_keep_jax_words(topology):
  pid = jax.process_index()
  value = np.arange(4) + pid
  theirs, ours = _messages(
      AssertionError,
      lambda: jax_mhu.assert_equal(value, 'replicas diverged'),
      lambda: multihost.assert_equal(value, 'replicas diverged'))
  # JAX: '{fail_message}. Expected: {gathered}; got: {local}.'
  words = theirs.split('. Expected: ')[0]
  assert words == 'replicas diverged', theirs
  assert words in ours, (theirs, ours)
  name = 'odd' if pid == 1 else 'even'
  theirs, ours = _messages(
      AssertionError,
      lambda: jax_mhu.sync_global_devices(name),
      lambda: multihost.sync_global_devices(name))
  # JAX: "sync_global_devices name mismatch ('odd'). Expected: ...": its
  # words, then this process's name; ours names every process's.
  words = theirs.split(' (')[0]
  assert words == 'sync_global_devices name mismatch', theirs
  assert words in ours and repr(name) in ours, (theirs, ours)
