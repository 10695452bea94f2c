"""Every function works as one controller without jax.distributed (4 devices)."""

import hashlib
import pathlib
import re
import time
import zlib

import jax
from jax.experimental import multihost_utils as jax_mhu
import numpy as np
import pytest

import multihost
from multihost import env as env_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_runs_without_jax_distributed():
  assert not jax.distributed.is_initialized()
  assert jax.process_count() == 1 and jax.local_device_count() == 4


def test_initialize_without_cluster_is_a_no_op(monkeypatch):
  for var in (env_lib.COORDINATOR, env_lib.NUM_PROCESSES, env_lib.PROCESS_ID,
              env_lib.SLURM_JOB_ID, env_lib.OMPI_HNP_URI):
    monkeypatch.delenv(var, raising=False)
  multihost.initialize()
  assert not jax.distributed.is_initialized()
  with pytest.raises(ValueError, match='together'):
    multihost.initialize(coordinator_address='127.0.0.1:1')
  with pytest.raises(ValueError, match='process_id=3, num_processes=2'):
    multihost.initialize('127.0.0.1:1', 2, 3)


def test_broadcast_and_allgather_give_the_shapes_of_many_processes():
  tree = {'s': np.float32(2.0), 'v': np.arange(3, dtype=np.int32),
          'k': jax.random.key(3), 'f': 1.5}
  out = multihost.broadcast_one_to_all(tree)
  assert out['s'].shape == () and out['v'].tolist() == [0, 1, 2]
  assert out['f'].dtype == np.float32  # The dtype a device would give.
  stacked = multihost.process_allgather(tree)
  assert stacked['s'].shape == (1,) and stacked['v'].shape == (1, 3)
  assert stacked['k'].shape == (1,)
  tiled = multihost.process_allgather(tree, tiled=True)
  assert tiled['s'].shape == (1,) and tiled['v'].shape == (3,)
  with pytest.raises(multihost.ConsistencyError, match='no process is the source'):
    multihost.broadcast_one_to_all(tree, is_source=False)


def test_results_are_copies():
  x = np.arange(3)
  out = multihost.broadcast_one_to_all(x)
  out[0] = 7
  assert x[0] == 0


def test_barrier_assert_and_objects():
  multihost.sync_global_devices('anything')
  multihost.assert_equal({'a': np.ones(3)}, 'never raises with one process')
  assert multihost.allgather_object({'a': 1}) == [{'a': 1}]
  assert multihost.broadcast_object([1, 2]) == [1, 2]
  assert multihost.reached_preemption_sync_point(0) is False
  with pytest.raises(TypeError, match='name must be a str'):
    multihost.sync_global_devices(3)


def test_tree_digest():
  a = {'w': np.arange(4, dtype=np.float32), 'k': jax.random.key(1)}
  b = {'w': np.arange(4, dtype=np.float32), 'k': jax.random.key(1)}
  assert multihost.tree_digest(a) == multihost.tree_digest(b)
  assert len(multihost.tree_digest(a)) == 32
  b['w'] = b['w'] + 1
  assert multihost.tree_digest(a) != multihost.tree_digest(b)
  # Same bytes, other dtype or shape: other digest.
  assert multihost.tree_digest(np.zeros(4, np.int32)) != multihost.tree_digest(
      np.zeros(4, np.float32))
  assert multihost.tree_digest(np.zeros((2, 2))) != multihost.tree_digest(
      np.zeros(4))
  big = np.random.default_rng(0).normal(size=(9 << 20) // 8 * 3)  # chunked path
  assert multihost.tree_digest(big) == multihost.tree_digest(big.copy())
  # The > 1 MiB chunked digest, computed independently from its definition:
  # SHA-256 of the spec, a tag and the CRC-32s of 4 MiB chunks, cut to 16 B;
  # of the leaf's own float64 bytes, or (version 1, x64 off) of the float32
  # a device would hold.
  def chunked(spec: str, data: bytes) -> dict[str, str]:
    h = hashlib.sha256(spec.encode())
    h.update(b'crc32-4MiB')
    for i in range(0, len(data), 4 << 20):
      h.update(zlib.crc32(data[i:i + (4 << 20)]).to_bytes(4, 'little'))
    return {'<root>': h.hexdigest()[:32]}

  assert not jax.config.jax_enable_x64
  assert multihost.leaf_digests(big) == chunked(f'float64[{big.size}]',
                                                big.tobytes())
  assert multihost.leaf_digests(big, version=1) == chunked(
      f'float32[{big.size}]', big.astype(np.float32).tobytes())
  flipped = big.copy()
  flipped.view(np.uint8)[-8] ^= 1  # The last item's lowest bit.
  assert multihost.leaf_digests(flipped) != multihost.leaf_digests(big)
  # (Version 1 never saw it: the gap version 2 closed.)
  assert (multihost.leaf_digests(flipped, version=1)
          == multihost.leaf_digests(big, version=1))
  per_leaf = multihost.leaf_digests(a)
  assert list(per_leaf) == ["['k']", "['w']"]
  assert per_leaf == multihost.leaf_digests(
      {'w': np.arange(4, dtype=np.float32), 'k': jax.random.key(1)})
  # Sharded or not, the same value has the same digest.
  mesh = jax.make_mesh((4,), ('x',))
  sharded = jax.device_put(np.arange(8.0, dtype=np.float32),
                           jax.NamedSharding(mesh, jax.P('x')))
  assert multihost.tree_digest(sharded) == multihost.tree_digest(
      np.arange(8.0, dtype=np.float32))



def test_digests_use_the_fast_crc32_where_isal_is_installed():
  # ISA-L's CRC-32 gives zlib's values (checked against zlib above) ~5x
  # faster; a broken import would silently fall back to zlib.
  isal_zlib = pytest.importorskip(
      'isal.isal_zlib', reason='isal has no wheel for this platform; the '
      'digests then use zlib.crc32 (the same values)')
  from multihost._src.api import digest
  assert digest._crc32_of is isal_zlib.crc32
  data = np.random.default_rng(3).integers(0, 255, 5 << 20, np.uint8)
  assert digest._crc32_of(data) == zlib.crc32(data)

def test_array_conversions_on_one_process():
  mesh = jax.make_mesh((1, 4), ('host', 'dev'))
  local = np.arange(8.0, dtype=np.float32).reshape(4, 2)
  g = multihost.host_local_array_to_global_array(local, mesh, jax.P('dev'))
  assert g.shape == (4, 2) and len(g.addressable_shards) == 4
  back = multihost.global_array_to_host_local_array(g, mesh, jax.P('dev'))
  assert back is g  # Fully addressable: returned as is.
  with pytest.raises(ValueError, match=re.escape('PartitionSpec()')):
    multihost.host_local_array_to_global_array(local, mesh, None)


@pytest.mark.parametrize('spec', [jax.P(), jax.P('dev'), jax.P(None, 'dev')])
def test_large_unaligned_inputs_are_placed_exactly_and_not_aliased(spec):
  # Larger than 256 KiB and not 64-byte aligned, so the conversion makes its
  # own aligned copy (the device would copy it anyway) of each slice.
  mesh = jax.make_mesh((1, 4), ('host', 'dev'))
  buffer = np.arange(2 * 4 * 65536 + 3, dtype=np.float32)
  local = buffer[3:].reshape(2 * 4, 65536)[:, ::1]
  assert local.ctypes.data % 64 and local.nbytes > 256 << 10
  theirs = jax_mhu.host_local_array_to_global_array(local, mesh, spec)
  ours = multihost.host_local_array_to_global_array(local, mesh, spec)
  assert ours.sharding == theirs.sharding
  for a, b in zip(ours.addressable_shards, theirs.addressable_shards,
                  strict=True):
    assert a.index == b.index and a.device == b.device
    np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
  expected = local.copy()
  local[:] = -1.0  # The global array holds a copy, not the caller's memory.
  np.testing.assert_array_equal(np.asarray(ours), expected)


def test_tracers_are_rejected_clearly():
  with pytest.raises(TypeError, match='outside transformed code'):
    jax.jit(multihost.process_allgather)(np.ones(2))


def test_default_timeout(monkeypatch):
  monkeypatch.setenv(env_lib.TIMEOUT, '12')
  assert multihost.default_timeout() == 12
  multihost.set_default_timeout(3)
  try:
    assert multihost.default_timeout() == 3
  finally:
    multihost.set_default_timeout(None)
  assert multihost.default_timeout() == 12
  monkeypatch.setenv(env_lib.TIMEOUT, 'soon')
  with pytest.raises(ValueError, match='MULTIHOST_TIMEOUT'):
    multihost.default_timeout()
  with pytest.raises(ValueError, match='positive'):
    multihost.set_default_timeout(0)


def test_call_watched_keeps_its_timeout_without_a_watchdog():
  # One process: no failure watchdog runs, yet the timeout holds, and
  # call_watched takes the default timeout when given none.
  start = time.monotonic()
  with pytest.raises(multihost.CollectiveTimeoutError, match='sleep'):
    multihost.call_watched(time.sleep, 1.5, op='sleep', timeout=0.3)
  assert time.monotonic() - start < 1.2
  multihost.set_default_timeout(0.3)
  try:
    start = time.monotonic()
    with pytest.raises(multihost.CollectiveTimeoutError):
      multihost.call_watched(time.sleep, 1.5, op='sleep')
    assert time.monotonic() - start < 1.2
  finally:
    multihost.set_default_timeout(None)
  assert multihost.call_watched(lambda a: a + 1, 1, op='add') == 2


def test_jax_internals_confined_to_one_module():
  """Only multihost/_src/runtime/coordination.py may import jax._src (no public client)."""
  offenders = []
  for folder in ('multihost', 'recovery', 'bin'):
    for path in sorted((ROOT / folder).rglob('*.py')):
      text = path.read_text()
      if re.search(r'^\s*(from|import)\s+jax\._src', text, re.M):
        offenders.append(str(path.relative_to(ROOT)))
  assert offenders == ['multihost/_src/runtime/coordination.py']


def test_public_names_match_jax_multihost_utils():
  import inspect

  from jax.experimental import multihost_utils as jax_mhu
  for name in ('broadcast_one_to_all', 'process_allgather',
               'sync_global_devices', 'assert_equal',
               'host_local_array_to_global_array',
               'global_array_to_host_local_array',
               'reached_preemption_sync_point'):
    ours = inspect.signature(getattr(multihost, name)).parameters
    theirs = inspect.signature(getattr(jax_mhu, name)).parameters
    positional = [p for p in ours.values() if p.kind != p.KEYWORD_ONLY]
    assert [p.name for p in positional] == list(theirs), name
    for p in positional:
      assert p.default == theirs[p.name].default, (name, p.name)


def test_tree_digest_matches_the_multi_process_topologies():
  # The same constant as tests/multiprocess/test_collectives.py at 2x4, 2x2 and 4x1.
  mesh = jax.make_mesh((jax.device_count(),), ('x',))
  full = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
  sharded = jax.make_array_from_callback(
      full.shape, jax.NamedSharding(mesh, jax.P('x')), lambda i: full[i])
  want = 'c9ddd7450c5c28ac62c6d249d1550117'
  assert multihost.tree_digest({'a': sharded, 'b': np.int32(3)}) == want
  assert multihost.tree_digest({'a': full, 'b': np.int32(3)}) == want


@pytest.mark.parametrize('axis_type', ['auto', 'explicit'])
def test_conversions_work_under_jit(axis_type):
  kind = (jax.sharding.AxisType.Auto if axis_type == 'auto'
          else jax.sharding.AxisType.Explicit)
  mesh = jax.make_mesh((1, 4), ('host', 'dev'), axis_types=(kind, kind))
  x = np.arange(32, dtype=np.float32).reshape(4, 8)
  for spec in (jax.P('dev'), jax.P(), jax.P(None, 'dev')):
    ours = jax.jit(lambda a, s=spec: multihost.host_local_array_to_global_array(
        a, mesh, s) * 2)(x)
    theirs = jax.jit(lambda a, s=spec: jax_mhu.host_local_array_to_global_array(
        a, mesh, s) * 2)(x)
    np.testing.assert_array_equal(ours, theirs)
    if axis_type == 'auto':  # Laid out as the global sharding.
      assert ours.sharding.is_equivalent_to(jax.NamedSharding(mesh, spec), 2)
    back = jax.jit(lambda a, s=spec: multihost.global_array_to_host_local_array(
        a, mesh, s) + 1)(x)
    np.testing.assert_array_equal(back, x + 1)
    grad = jax.grad(lambda a, s=spec: multihost.host_local_array_to_global_array(
        a, mesh, s).sum())(x)
    np.testing.assert_array_equal(grad, np.ones_like(x))


def test_results_keep_float64_when_x64_is_turned_on_later():
  x = np.arange(3, dtype=np.float64)
  assert multihost.process_allgather(x).dtype == np.float32  # x64 off.
  with jax.enable_x64(True):
    for out in (multihost.process_allgather(x),
                multihost.broadcast_one_to_all(x),
                jax_mhu.process_allgather(x)):
      assert out.dtype == np.float64, out.dtype
    np.testing.assert_array_equal(multihost.process_allgather(x), [x])
