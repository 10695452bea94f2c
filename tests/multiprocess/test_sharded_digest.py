"""Digests of states sharded across processes: topology-independent, never gathered whole.

Real controllers at 2x2 and 4x1 (processes x devices), and at 1x4 the parent
pytest itself (one controller with 4 CPU devices, as conftest.py sets them
up; a launch of its own would only repeat that). Every digest of
a sharded array must equal the digest of the same content held as one host
array on one process (a pure function of the content), so the digests agree
across topologies. The memory tests reset the kernel's peak-RSS counter
(/proc/self/clear_refs) and read VmHWM after the call.
"""

from __future__ import annotations

import gc
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from topologies import topologies as topology_params

import multihost

topologies = pytest.mark.parametrize('topology', [
    *topology_params('2x2', '4x1', timeout=300).args[1], '1x4'])

_MiB = 1 << 20


def _content(shape, dtype, seed):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(shape) * 1000).astype(dtype)


def _place(value, mesh, spec):
  sharding = jax.sharding.NamedSharding(mesh, spec)
  return jax.make_array_from_callback(value.shape, sharding,
                                      lambda i: value[i])


def _cases():
  """(name, host value, mesh, partition spec): over 1 MiB unless named small."""
  flat = jax.make_mesh((4,), ('x',))
  square = jax.make_mesh((2, 2), ('a', 'b'))
  P = jax.P  # pylint: disable=invalid-name
  rows = _content((24, 40_000), np.float32, 1)  # 3.7 MiB: shards cut chunks
  narrow = _content((300_000, 8), np.int32, 2)  # strided runs of 2 or 4
  cube = _content((8, 12, 6_000), jnp.bfloat16, 3)
  small = _content((64, 8), np.float32, 4)
  scattered = _content((40_000, 2, 8), np.int32, 5)  # few short runs a row
  return [
      ('rows', rows, flat, P('x')),
      ('columns', rows, flat, P(None, 'x')),
      ('box', rows, square, P('a', 'b')),
      ('replicated over b', rows, square, P('a')),
      ('replicated over a', rows, square, P(None, 'b')),
      ('narrow columns', narrow, flat, P(None, 'x')),
      ('narrow box', narrow, square, P('b', 'a')),
      ('cube', cube, square, P(None, 'a', 'b')),
      ('scattered', scattered, square, P('b', None, 'a')),
      ('scattered, replicated over b', scattered, square, P(None, None, 'a')),
      ('small', small, flat, P('x')),
      ('fully replicated', rows, flat, P()),
  ]


@topologies
def test_sharded_digest_equals_the_host_value_digest(topology):
  cases = _cases()
  tree = {name: _place(value, mesh, spec)
          for name, value, mesh, spec in cases}
  host = {name: value for name, value, _, _ in cases}
  if topology != '1x4':
    assert not tree['rows'].is_fully_addressable
  got = multihost.leaf_digests(tree)
  want = multihost.leaf_digests(host)
  assert got == want, {k for k in got if got[k] != want[k]}
  digest = multihost.tree_digest(tree)
  assert digest == multihost.tree_digest(host)
  print(f'{topology} tree_digest {digest}')
  # The same on every process, and content-sensitive.
  assert len(set(multihost.allgather_object(digest))) == 1
  changed = host['rows'].copy()
  changed[23, 39_999] += 1  # The last item, in the last chunk.
  flat = jax.make_mesh((4,), ('x',))
  assert (multihost.leaf_digests({'rows': _place(changed, flat, jax.P(
      None, 'x'))})["['rows']"] != want["['rows']"])


@topologies
def test_sharded_key_array_digest(topology):
  keys = jax.random.split(jax.random.key(3), 1 << 18)  # 2 MiB of key data
  data = np.asarray(jax.random.key_data(keys))
  mesh = jax.make_mesh((4,), ('x',))
  sharded = jax.make_array_from_callback(
      keys.shape, jax.sharding.NamedSharding(mesh, jax.P('x')),
      lambda i: jax.random.wrap_key_data(data[i]))
  assert multihost.tree_digest(sharded) == multihost.tree_digest(keys)
  multihost.assert_equal(sharded)  # Shard by shard, with key data axes.


def _status(field: str) -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field + ':'):
        return int(line.split()[1]) * 1024
  raise AssertionError(f'no {field} in /proc/self/status')


def _peak_increase(fn):
  """Bytes by which `fn()` raises this process's peak RSS (and its result)."""
  gc.collect()
  time.sleep(0.5)  # Let earlier asynchronous work and frees land.
  multihost.sync_global_devices('measure')
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
  except OSError as e:
    pytest.skip(f'cannot reset the peak RSS counter: {e}')
  before = _status('VmRSS')
  out = fn()
  return _status('VmHWM') - before, out


def _big_sharded(n):
  mesh = jax.make_mesh((jax.device_count(),), ('x',))
  sharding = jax.sharding.NamedSharding(mesh, jax.P('x'))
  return jax.make_array_from_callback(
      (n,), sharding, lambda i: np.arange(i[0].start, i[0].stop,
                                          dtype=np.int32))


@pytest.mark.multihost(num_processes=2, devices_per_process=2, timeout=300)
def test_tree_digest_of_256_mib_sharded_over_2_processes_stays_bounded():
  x = _big_sharded(64 * _MiB)  # 256 MiB of int32: 128 MiB per process
  assert sum(s.data.nbytes for s in x.addressable_shards) == 128 * _MiB
  multihost.tree_digest(x)  # Warm up.
  peak, digest = _peak_increase(lambda: multihost.tree_digest({'w': x}))
  assert peak < 64 * _MiB, f'tree_digest raised the peak by {peak / _MiB} MiB'
  peak, _ = _peak_increase(lambda: multihost.assert_equal({'w': x}))
  assert peak < 64 * _MiB, f'assert_equal raised the peak by {peak / _MiB} MiB'
  # The digest is the one of the whole value in one host array.
  if jax.process_index() == 0:
    whole = np.arange(64 * _MiB, dtype=np.int32)
    assert multihost.tree_digest({'w': whole}) == digest


@pytest.mark.multihost(num_processes=2, devices_per_process=2, timeout=300)
def test_checkpoint_of_256_mib_sharded_over_2_processes_stays_bounded(
    multihost_tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  import recovery  # pylint: disable=import-outside-toplevel
  recovery.quiet_orbax_logs()
  n = 64 * _MiB
  own = 128 * _MiB
  state = recovery.TransitionState(
      user={'w': _big_sharded(n)}, key=jax.random.key(1),
      order=np.arange(8, dtype=np.int32), cursor=0, epoch=0, step=1)
  zeros = jax.make_array_from_callback(
      (n,), state.user['w'].sharding, lambda i: np.zeros(
          i[0].stop - i[0].start, np.int32))
  target = state.replace(user={'w': zeros}, step=0)
  with recovery.Checkpoints(multihost_tmp_path / 'ckpt', save_every=1,
                            async_save=False) as checkpoints:
    save_peak, _ = _peak_increase(
        lambda: checkpoints.save(state, force=True))
    restore_peak, restored = _peak_increase(
        lambda: jax.block_until_ready(checkpoints.restore(target)))
  assert save_peak < own + 64 * _MiB, f'save: {save_peak / _MiB} MiB'
  del restored
  # Restoring allocates the restored shards (own); Orbax itself reads them
  # through a host buffer of the same size. Ours adds at most 64 MiB to that.
  plain = ocp.StandardCheckpointer()
  tree = target.to_tree()
  abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
      if isinstance(a, jax.Array) else a, tree)
  folder = os.path.join(multihost_tmp_path, 'plain')
  plain.save(folder, state.to_tree())
  plain.wait_until_finished()
  plain_peak, out = _peak_increase(
      lambda: jax.block_until_ready(plain.restore(folder, abstract)))
  del out
  plain.close()
  assert restore_peak < max(plain_peak, own) + 64 * _MiB, (
      f'restore: {restore_peak / _MiB} MiB, plain Orbax {plain_peak / _MiB}')
