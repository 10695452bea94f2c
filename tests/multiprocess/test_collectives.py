"""Multi-process tests of the JAX-compatible collectives.

Every test here runs in real controllers (jax.distributed over gloo on
localhost) at two topologies: 2 processes x 4 devices and 4 x 1.
"""

import re
import time

import jax
from jax.experimental import multihost_utils as jax_mhu
import jax.numpy as jnp
import numpy as np
import pytest
from topologies import topologies as topology_params

import multihost
import multihost.env
import multihost.lowlevel

# One group timeout for every test here: the plugin launches one group of
# controllers per (topology, timeout), so every test of a topology shares a
# launch. It bounds the whole group; each collective times out after 60 s.
GROUP_TIMEOUT_S = 600
topologies = topology_params('2x4', '4x1', timeout=GROUP_TIMEOUT_S)


def _me():
  return jax.process_index(), jax.process_count()


def _all_dtypes_tree(pid):
  return {
      'u8': np.arange(5, dtype=np.uint8) + pid,
      'b': np.array([True, False, bool(pid % 2)]),
      'i32': np.arange(6, dtype=np.int32).reshape(2, 3) * (pid + 1),
      'f32': jnp.linspace(0, 1, 4, dtype=jnp.float32) + pid,
      'bf16': jnp.array([1.5, -2.0], dtype=jnp.bfloat16) * (pid + 1),
      'key': jax.random.key(pid),
      'scalar0d': np.float32(pid),
      'py_int': 7 + pid,
      'py_float': 0.5 * pid,
  }


@topologies
def test_broadcast_preserves_dtypes_and_values(topology):
  pid, count = _me()
  out = multihost.broadcast_one_to_all(_all_dtypes_tree(pid))
  want = _all_dtypes_tree(0)
  assert out['u8'].dtype == np.uint8 and out['u8'].tolist() == want['u8'].tolist()
  assert out['b'].dtype == np.bool_ and out['b'].tolist() == [True, False, False]
  assert out['i32'].dtype == np.int32 and out['i32'].shape == (2, 3)
  assert out['i32'].tolist() == [[0, 1, 2], [3, 4, 5]]
  assert out['f32'].dtype == np.float32
  np.testing.assert_array_equal(out['f32'],
                                np.linspace(0, 1, 4, dtype=np.float32))
  assert out['bf16'].dtype == jnp.bfloat16
  assert out['bf16'].tolist() == [1.5, -2.0]
  assert jax.dtypes.issubdtype(out['key'].dtype, jax.dtypes.prng_key)
  np.testing.assert_array_equal(jax.random.key_data(out['key']),
                                jax.random.key_data(jax.random.key(0)))
  assert out['scalar0d'].shape == () and out['scalar0d'].dtype == np.float32
  assert float(out['scalar0d']) == 0.0
  assert out['py_int'].dtype == np.int32 and int(out['py_int']) == 7
  assert out['py_float'].dtype == np.float32 and float(out['py_float']) == 0.0
  # A source other than process 0.
  last = multihost.broadcast_one_to_all(np.int32(pid), is_source=pid == count - 1)
  assert int(last) == count - 1


@topologies
def test_allgather_stacked_and_tiled_keep_jax_semantics(topology):
  pid, count = _me()
  tree = _all_dtypes_tree(pid)
  stacked = multihost.process_allgather(tree)
  assert stacked['i32'].shape == (count, 2, 3)
  assert stacked['scalar0d'].shape == (count,)
  assert stacked['key'].shape == (count,)
  assert stacked['bf16'].dtype == jnp.bfloat16
  for p in range(count):
    np.testing.assert_array_equal(stacked['u8'][p], np.arange(5) + p)
    np.testing.assert_array_equal(jax.random.key_data(stacked['key'][p]),
                                  jax.random.key_data(jax.random.key(p)))
  tiled = multihost.process_allgather(tree, tiled=True)
  assert tiled['i32'].shape == (2 * count, 3)
  assert tiled['scalar0d'].shape == (count,)  # A tiled scalar gives (P,).
  assert tiled['py_int'].shape == (count,)
  assert tiled['u8'].shape == (5 * count,)
  # The values, process by process, in process order.
  np.testing.assert_array_equal(tiled['scalar0d'], np.arange(count))
  assert tiled['py_int'].tolist() == [7 + p for p in range(count)]
  np.testing.assert_array_equal(
      tiled['u8'], np.concatenate([np.arange(5) + p for p in range(count)]))
  np.testing.assert_array_equal(tiled['i32'], np.concatenate(
      [np.arange(6).reshape(2, 3) * (p + 1) for p in range(count)]))
  np.testing.assert_array_equal(tiled['bf16'], np.concatenate(
      [np.array([1.5, -2.0]) * (p + 1) for p in range(count)]).astype(
          jnp.bfloat16))
  np.testing.assert_array_equal(
      jax.random.key_data(tiled['key']),
      np.stack([jax.random.key_data(jax.random.key(p)) for p in range(count)]))
  # Every leaf as JAX's gives it (JAX's cannot gather key leaves).
  no_keys = {k: v for k, v in tree.items() if k != 'key'}
  _assert_same({k: v for k, v in tiled.items() if k != 'key'},
               jax_mhu.process_allgather(no_keys, tiled=True))


def _random_tree(rng, pid, same_for_all):
  """A random pytree of numpy/jax leaves; values differ by process."""
  dtypes = [np.float32, np.int32, np.uint8, np.bool_, jnp.bfloat16]
  tree = {}
  for i in range(int(rng.integers(1, 6))):
    shape = tuple(int(n) for n in rng.integers(1, 4, size=rng.integers(0, 3)))
    dtype = dtypes[int(rng.integers(len(dtypes)))]
    base = rng.normal(size=shape) * 10
    value = base if same_for_all else base + pid
    leaf = np.asarray(value).astype(dtype)
    if rng.integers(2):
      leaf = jnp.asarray(leaf)
    tree[f'leaf{i}'] = leaf if i % 2 else [leaf, (leaf,)]
  return tree


def _assert_same(ours, theirs):
  ours_leaves, ours_def = jax.tree.flatten(ours)
  theirs_leaves, theirs_def = jax.tree.flatten(theirs)
  assert ours_def == theirs_def
  for a, b in zip(ours_leaves, theirs_leaves, strict=True):
    if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
      assert jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    else:
      assert isinstance(a, np.ndarray)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.shape, b.shape)
    # Equal bytes are equal arrays; numpy's element-wise comparison (and
    # its message) only where they differ: it is slow on 64 MiB leaves.
    if np.ascontiguousarray(a).tobytes() != np.ascontiguousarray(b).tobytes():
      np.testing.assert_array_equal(a, b)


# The differential test's topologies (processes x devices): 2x2 and 4x1.
parity_topologies = topology_params('2x2', '4x1', timeout=GROUP_TIMEOUT_S)


def _big_random_tree(rng, pid, nbytes):
  """Random leaves of several dtypes, one of them `nbytes` (> 64 KiB)."""
  n = nbytes // 4
  tree = _random_tree(rng, pid, same_for_all=False)
  tree['big_f32'] = (rng.normal(size=n).astype(np.float32) + pid)
  tree['mid_i32'] = rng.integers(-9, 9, (70_000 // 4 + int(rng.integers(9)),),
                                 dtype=np.int32) + pid
  tree['mid_bf16'] = jnp.asarray(rng.normal(size=(3, 12_000)) + pid,
                                 dtype=jnp.bfloat16)
  return tree


@parity_topologies
def test_parity_with_jax_on_random_trees_large_leaves_and_sources(topology):
  """Ours == JAX's on random trees: small, > 64 KiB and 64 MiB (TCP) leaves."""
  pid, count = _me()
  assert multihost.lowlevel.tcp_transport_enabled()
  for seed in range(3):
    rng = np.random.default_rng(100 + seed)
    tree = _big_random_tree(rng, pid, 256 * 1024 * (seed + 1))
    _assert_same(multihost.broadcast_one_to_all(tree),
                 jax_mhu.broadcast_one_to_all(tree))
    source = int(rng.integers(count))  # An explicit source.
    _assert_same(multihost.broadcast_one_to_all(tree, is_source=pid == source),
                 jax_mhu.broadcast_one_to_all(tree, is_source=pid == source))
    for tiled in (False, True):
      _assert_same(multihost.process_allgather(tree, tiled=tiled),
                   jax_mhu.process_allgather(tree, tiled=tiled))
  # 64 MiB: broadcast a 64 MiB leaf; all-gather 64 MiB in all (the result).
  big = np.random.default_rng(7).random(16 * 2**20, dtype=np.float32) + pid
  for is_source in (None, pid == count - 1):
    _assert_same(multihost.broadcast_one_to_all(big, is_source=is_source),
                 jax_mhu.broadcast_one_to_all(big, is_source=is_source))
  part = big[:big.size // count]
  _assert_same(multihost.process_allgather(part, tiled=True),
               jax_mhu.process_allgather(part, tiled=True))


@topologies
def test_tiled_must_agree_on_every_path(topology):
  """A tiled mismatch raises everywhere, inline (small) or not (large)."""
  pid, _ = _me()
  for n in (4, 100_000):  # Inline payloads, and the data-plane path.
    x = np.arange(n, dtype=np.float32) + pid
    with pytest.raises(multihost.ConsistencyError, match="'tiled' differs"):
      multihost.process_allgather(x, tiled=pid == 0)
    # The processes are still in step.
    assert multihost.process_allgather(np.int32(pid)).tolist() == list(
        range(jax.process_count()))


@topologies
def test_differential_against_jax_multihost_utils(topology):
  pid, _ = _me()
  trees = [_random_tree(np.random.default_rng(seed), pid, same_for_all=False)
           for seed in range(6)]
  # JAX's results for every tree from one call each (JAX compiles a call per
  # tree structure; ours compiles nothing): a leaf's result does not depend
  # on the leaves beside it.
  want = {'broadcast': jax_mhu.broadcast_one_to_all(trees),
          'stacked': jax_mhu.process_allgather(trees),
          'tiled': jax_mhu.process_allgather(trees, tiled=True)}
  for seed, tree in enumerate(trees):
    _assert_same(multihost.broadcast_one_to_all(tree), want['broadcast'][seed])
    _assert_same(multihost.process_allgather(tree), want['stacked'][seed])
    _assert_same(multihost.process_allgather(tree, tiled=True),
                 want['tiled'][seed])
  same = [_random_tree(np.random.default_rng(seed), pid, same_for_all=True)
          for seed in range(6)]
  for tree in same:
    multihost.assert_equal(tree)
  jax_mhu.assert_equal(same)


_compiles = []


def _count_compiles(event, duration, **kwargs):
  del duration, kwargs
  if event == '/jax/core/compile/backend_compile_duration':
    _compiles.append(event)


@topologies
def test_large_payloads_take_the_device_path(topology, monkeypatch):
  pid, count = _me()
  monkeypatch.setenv(multihost.env.TRANSPORT, 'device')
  assert not multihost.lowlevel.tcp_transport_enabled()
  # Proof the device path runs: its collectives compile programs (the TCP
  # path compiles none). Odd sizes give programs no earlier test compiled.
  jax.monitoring.register_event_duration_secs_listener(_count_compiles)
  try:
    before = len(_compiles)
    odd = np.arange((1 << 18) + 4099, dtype=np.float32) + pid
    np.testing.assert_array_equal(multihost.broadcast_one_to_all(odd),
                                  odd - pid)
    after_broadcast = len(_compiles)
    rows = multihost.process_allgather(odd)
    after_gather = len(_compiles)
  finally:
    jax.monitoring.unregister_event_duration_listener(_count_compiles)
  assert after_broadcast > before and after_gather > after_broadcast, (
      before, after_broadcast, after_gather)
  np.testing.assert_array_equal(rows, np.stack([odd - pid + p
                                                for p in range(count)]))
  big = np.arange(1 << 19, dtype=np.float32) + pid  # 2 MiB per process
  np.testing.assert_array_equal(multihost.broadcast_one_to_all(big), big - pid)
  gathered = multihost.process_allgather({'x': big, 'y': np.int8(pid)})
  assert gathered['x'].shape == (count, 1 << 19)
  for p in range(count):
    np.testing.assert_array_equal(gathered['x'][p], big - pid + p)
  assert gathered['y'].tolist() == list(range(count))
  # A source in the middle of the chain, and again (connections are reused).
  for _ in range(2):
    got = multihost.broadcast_one_to_all(big, is_source=pid == count - 1)
    np.testing.assert_array_equal(got, big - pid + count - 1)
  blob = multihost.broadcast_object(b'x' * 300_000 if pid == 0 else None)
  assert blob == b'x' * 300_000
  blobs = multihost.allgather_object('y' * (100_000 + pid))
  assert [len(b) for b in blobs] == [100_000 + p for p in range(count)]


@topologies
def test_small_payloads_travel_in_the_headers_without_tcp(topology,
                                                          monkeypatch):
  pid, count = _me()
  monkeypatch.setenv(multihost.env.TRANSPORT, 'device')
  small = {'a': np.arange(5, dtype=np.int32) + 100 * pid, 'b': np.float32(pid)}
  for source in (0, count - 1):  # An explicit source: the first, the last.
    got = multihost.broadcast_one_to_all(small, is_source=pid == source)
    _assert_same(got, jax_mhu.broadcast_one_to_all(small,
                                                   is_source=pid == source))
    np.testing.assert_array_equal(got['a'], np.arange(5) + 100 * source)
  _assert_same(multihost.broadcast_one_to_all(small),
               jax_mhu.broadcast_one_to_all(small))
  _assert_same(multihost.process_allgather(small),
               jax_mhu.process_allgather(small))
  with pytest.raises(multihost.ConsistencyError,
                     match=r'processes \[0, 1\] are all the source'):
    multihost.broadcast_one_to_all(small, is_source=pid in (0, 1))


@topologies
def test_a_late_process_joins_the_fallback_without_a_window_of_its_own(
    topology):
  # The others give up on the fast path after its 1 s window (the service
  # fails the barrier 1-2 s in) and wait in the full exchange; the late
  # process must join them at once, not wait out a window of its own at the
  # abandoned barrier (which would take late + 1 s or more).
  pid, count = _me()
  late = 3.0
  calls = {
      'process_allgather': lambda: multihost.process_allgather(np.int32(pid)),
      'allgather_object': lambda: multihost.allgather_object(pid),
      'broadcast_one_to_all(is_source)': lambda: multihost.broadcast_one_to_all(
          np.int32(pid), is_source=pid == count - 1),
  }
  for name, call in calls.items():
    for _ in range(10):  # Past the backoff of any fallback: the fast path.
      multihost.sync_global_devices('on time')
    start = time.monotonic()
    if pid == count - 1:
      time.sleep(late)
    call()
    took = time.monotonic() - start
    assert took < late + 0.8, (name, took)


@topologies
def test_object_collectives(topology):
  pid, count = _me()
  config = {'lr': 0.1, 'path': '/tmp/x', 'seed': 17, 'names': ('a', 'b')}
  got = multihost.broadcast_object(config if pid == 0 else None)
  assert got == config
  assert multihost.allgather_object({'p': pid}) == [{'p': p} for p in range(count)]
  assert multihost.broadcast_object(pid, is_source=pid == 1) == 1
  last = count - 1  # an explicit source of a large object (data plane)
  assert multihost.broadcast_object(
      (pid, b'y' * 100_000) if pid == last else None,
      is_source=pid == last) == (last, b'y' * 100_000)
  # The default source beside explicit is_source=False elsewhere: the
  # default's shortcut cannot prove agreement, and the headers decide.
  assert multihost.broadcast_object(
      [pid, 'x' * 70_000] if pid == 0 else None,
      is_source=None if pid == 0 else False) == [0, 'x' * 70_000]
  assert multihost.broadcast_object(('small', pid), is_source=(
      None if pid == 0 else False)) == ('small', 0)


@topologies
def test_results_unaffected_by_mesh_context(topology):
  pid, count = _me()
  tree = {'a': np.arange(3, dtype=np.float32) + pid, 'k': jax.random.key(pid)}
  plain_b = multihost.broadcast_one_to_all(tree)
  plain_g = multihost.process_allgather(tree, tiled=True)
  mesh = jax.make_mesh((jax.device_count(),), ('data',))
  for context in (jax.set_mesh(mesh), mesh):
    with context:
      b = multihost.broadcast_one_to_all(tree)
      g = multihost.process_allgather(tree, tiled=True)
      multihost.sync_global_devices('in-context')
      multihost.assert_equal(np.ones(3))
    np.testing.assert_array_equal(b['a'], plain_b['a'])
    np.testing.assert_array_equal(g['a'], plain_g['a'])
    np.testing.assert_array_equal(jax.random.key_data(g['k']),
                                  jax.random.key_data(plain_g['k']))


def _global_rows(mesh, pid):
  """A (rows, 2) global array sharded by rows; process p's rows are 10p + i."""
  local = np.arange(8, dtype=np.float32).reshape(4, 2) + 10 * pid
  return local, multihost.host_local_array_to_global_array(
      local, mesh, jax.P(mesh.axis_names))


@topologies
def test_allgather_of_non_fully_addressable_array(topology):
  pid, count = _me()
  mesh = jax.make_mesh((jax.device_count(),), ('x',))
  if jax.local_device_count() > 4:
    pytest.fail('this test assumes at most 4 local devices')
  _, global_array = _global_rows(mesh, pid)
  assert not global_array.is_fully_addressable
  full = multihost.process_allgather(global_array, tiled=True)
  want = np.concatenate([np.arange(8, dtype=np.float32).reshape(4, 2) + 10 * p
                         for p in range(count)])
  np.testing.assert_array_equal(full, want)
  np.testing.assert_array_equal(
      full, jax_mhu.process_allgather(global_array, tiled=True))
  with pytest.raises(ValueError, match='tiled=True'):
    multihost.process_allgather(global_array, tiled=False)
  keys = jax.random.split(jax.random.key(0), jax.device_count())
  global_keys = jax.jit(
      lambda: jax.random.split(jax.random.key(0), jax.device_count()),
      out_shardings=jax.NamedSharding(mesh, jax.P('x')))()
  assert not global_keys.is_fully_addressable
  got = multihost.process_allgather(global_keys, tiled=True)
  np.testing.assert_array_equal(jax.random.key_data(got),
                                jax.random.key_data(keys))


@topologies
def test_host_local_to_global_and_back(topology):
  pid, count = _me()
  local_n = jax.local_device_count()
  mesh = jax.make_mesh((count, local_n), ('host', 'dev'))
  local = np.arange(local_n * 2 * 3, dtype=np.float32).reshape(
      local_n * 2, 3) + 100 * pid
  ours = multihost.host_local_array_to_global_array(
      local, mesh, jax.P(('host', 'dev')))
  theirs = jax_mhu.host_local_array_to_global_array(
      local, mesh, jax.P(('host', 'dev')))
  assert ours.shape == theirs.shape == (count * local_n * 2, 3)
  assert ours.sharding.is_equivalent_to(theirs.sharding, 2)
  np.testing.assert_array_equal(multihost.process_allgather(ours, tiled=True),
                                multihost.process_allgather(theirs, tiled=True))
  # Already global: the same object back.
  assert multihost.host_local_array_to_global_array(
      ours, mesh, jax.P(('host', 'dev'))) is ours
  # Back to host-local: the same values, and it shares the global buffers.
  back = multihost.global_array_to_host_local_array(
      ours, mesh, jax.P(('host', 'dev')))
  assert back.is_fully_addressable and back.shape == local.shape
  np.testing.assert_array_equal(np.asarray(back), local)
  ptrs = {s.device: s.data.unsafe_buffer_pointer() for s in ours.addressable_shards}
  assert {s.device: s.data.unsafe_buffer_pointer()
          for s in back.addressable_shards} == ptrs
  # A local array already laid out as the local sharding: no copy.
  again = multihost.host_local_array_to_global_array(
      back, mesh, jax.P(('host', 'dev')))
  assert {s.device: s.data.unsafe_buffer_pointer()
          for s in again.addressable_shards} == ptrs
  # Replicated: P() keeps the shape; every device holds the whole value.
  rep = multihost.host_local_array_to_global_array(
      np.arange(4, dtype=np.int32), mesh, jax.P())
  assert rep.shape == (4,)
  assert all(s.data.shape == (4,) for s in rep.addressable_shards)
  # Locally replicated: P('host') replicates each process's rows over its
  # own devices, and stacks processes.
  per_host = multihost.host_local_array_to_global_array(
      np.full((2,), pid, np.int32), mesh, jax.P('host'))
  assert per_host.shape == (2 * count,)
  assert all(np.asarray(s.data).tolist() == [pid, pid]
             for s in per_host.addressable_shards)
  np.testing.assert_array_equal(
      multihost.process_allgather(per_host, tiled=True),
      np.repeat(np.arange(count, dtype=np.int32), 2))
  # A tree with a prefix of specs.
  tree = multihost.host_local_array_to_global_array(
      {'a': local, 'b': [np.int32(3)]}, mesh,
      {'a': jax.P(('host', 'dev')), 'b': jax.P()})
  assert tree['a'].shape == ours.shape and tree['b'][0].shape == ()
  with pytest.raises(ValueError, match=re.escape('PartitionSpec()')):
    multihost.host_local_array_to_global_array(local, mesh, None)
  with pytest.raises(ValueError, match=re.escape('PartitionSpec()')):
    multihost.global_array_to_host_local_array(ours, mesh, None)


@topologies
def test_non_contiguous_mesh(topology):
  """Devices interleaved across processes: p0d0, p1d0, ..., p0d1, p1d1, ..."""
  pid, count = _me()
  by_process = [sorted((d for d in jax.devices() if d.process_index == p),
                       key=lambda d: d.id) for p in range(count)]
  local_n = len(by_process[0])
  interleaved = [by_process[p][i] for i in range(local_n) for p in range(count)]
  mesh = jax.sharding.Mesh(np.array(interleaved), ('x',))
  local = np.arange(local_n * 2, dtype=np.float32) + 100 * pid
  global_array = multihost.host_local_array_to_global_array(
      local, mesh, jax.P('x'))
  assert global_array.shape == (count * local_n * 2,)
  # Each device holds its 2-row block of its process's local data.
  for shard in global_array.addressable_shards:
    i = interleaved.index(shard.device) // count  # position among own devices
    np.testing.assert_array_equal(np.asarray(shard.data), local[2 * i:2 * i + 2])
  back = multihost.global_array_to_host_local_array(global_array, mesh,
                                                    jax.P('x'))
  np.testing.assert_array_equal(np.asarray(back), local)
  with jax.set_mesh(mesh):
    got = multihost.broadcast_one_to_all({'v': local}, is_source=pid == count - 1)
  np.testing.assert_array_equal(got['v'], local - 100 * pid + 100 * (count - 1))
  # Global block j sits on interleaved[j]: process j % P, its block j // P.
  want = np.concatenate([
      np.arange(2 * (j // count), 2 * (j // count) + 2, dtype=np.float32)
      + 100 * (j % count) for j in range(count * local_n)])
  np.testing.assert_array_equal(
      multihost.process_allgather(global_array, tiled=True), want)


@topologies
def test_sync_global_devices_name_mismatch_raises_everywhere(topology):
  pid, count = _me()
  multihost.sync_global_devices('same-name')
  with pytest.raises(AssertionError) as info:
    multihost.sync_global_devices('odd' if pid == count - 1 else 'even')
  assert isinstance(info.value, multihost.ConsistencyError)
  message = str(info.value)
  assert "'odd'" in message and "'even'" in message
  assert f'process [{count - 1}]' in message
  multihost.sync_global_devices('still-in-step')


@topologies
def test_assert_equal_names_leaf_and_processes(topology):
  pid, count = _me()
  big = np.zeros(100_000, np.float32)
  tree = {'params': {'w': big + (pid == 1), 'b': np.ones(3)}, 'step': 5}
  with pytest.raises(AssertionError) as info:
    multihost.assert_equal(tree, 'my check failed:')
  assert isinstance(info.value, multihost.ConsistencyError)
  message = str(info.value)
  assert message.startswith('my check failed:')
  assert "['params']['w']" in message
  assert "['params']['b']" not in message and "['step']" not in message
  assert 'process [1]' in message
  assert len(message) < 2000  # Never the whole tree.
  multihost.assert_equal(tree['params']['b'])
  with pytest.raises(multihost.ConsistencyError, match='max abs difference'):
    multihost.assert_equal({'w': np.float32(pid == 1)}, show_diff=True)
  # Every bit of a 64-bit NumPy leaf counts (x64 off: JAX would cast it).
  assert not jax.config.jax_enable_x64
  wide = {'f64': np.array([1.0 + (pid == 1) * 2**-40]),
          'i64': np.array([5 + (pid == 1) * 2**40]), 'same': np.int64(pid * 0)}
  with pytest.raises(multihost.ConsistencyError,
                     match='2 of 3 leaves differ across processes') as info:
    multihost.assert_equal(wide)
  message = str(info.value)
  assert "\n  ['f64']: " in message and "\n  ['i64']: " in message, message
  assert "['same']" not in message


@topologies
def test_assert_equal_on_global_replicas(topology):
  pid, count = _me()
  mesh = jax.make_mesh((jax.device_count(),), ('x',))
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  def make(value):
    shards = [jax.device_put(value, d) for d in jax.local_devices()]
    return jax.make_array_from_single_device_arrays((3,), replicated, shards)
  multihost.assert_equal({'r': make(np.ones(3, np.float32))})
  with pytest.raises(multihost.ConsistencyError, match=r"\['r'\]"):
    multihost.assert_equal({'r': make(np.ones(3, np.float32) * (pid == 0))})


@topologies
def test_broadcast_needs_exactly_one_source(topology):
  pid, count = _me()
  with pytest.raises(multihost.ConsistencyError, match=r'processes \[0, 1\] are all the source'):
    multihost.broadcast_one_to_all(np.ones(3), is_source=pid in (0, 1))
  with pytest.raises(multihost.ConsistencyError, match='no process is the source'):
    multihost.broadcast_one_to_all(np.ones(3), is_source=False)
  with pytest.raises(multihost.ConsistencyError, match='no process is the source'):
    multihost.broadcast_object('x', is_source=False)
  with pytest.raises(multihost.ConsistencyError, match=r'processes \[0, 1\] are all the source'):
    multihost.broadcast_object('x', is_source=pid in (0, 1))
  assert int(multihost.broadcast_one_to_all(np.int32(pid))) == 0


@topologies
def test_mismatched_inputs_raise_instead_of_aborting(topology):
  pid, count = _me()
  odd = pid == count - 1
  cases = [
      ('shape', np.zeros(3 + odd, np.float32), r'float32\[3\].*float32\[4\]'),
      ('dtype', np.zeros(3, np.int32 if odd else np.float32), 'int32'),
      ('tree', {'a': 1, 'b': 2} if odd else {'a': 1}, 'tree structure'),
  ]
  for what, value, pattern in cases:
    for fn in (multihost.process_allgather, multihost.broadcast_one_to_all,
               multihost.assert_equal):
      with pytest.raises(multihost.ConsistencyError, match=pattern) as info:
        fn(value)
      assert f'process [{count - 1}]' in str(info.value) or (
          f'processes [{count - 1}]' in str(info.value)), (what, info.value)
  # Different collectives at the same point. (Their headers differ in more
  # than the op; test_calls_that_differ_only_in_their_op_raise_everywhere
  # has calls that differ in the op alone.)
  with pytest.raises(multihost.ConsistencyError, match='different collectives'):
    if odd:
      multihost.process_allgather(np.zeros(3))
    else:
      multihost.broadcast_one_to_all(np.zeros(3))
  # Large payloads are checked before the device collective too.
  with pytest.raises(multihost.ConsistencyError, match='differ'):
    multihost.process_allgather(np.zeros((1 << 18) + odd, np.float32))
  np.testing.assert_array_equal(multihost.process_allgather(np.int32(pid)),
                                np.arange(count))


def _differ_only_in_op(pid):
  """Calls whose agreement fields are equal but for the op, by op.

  The barrier and the object collectives have no tree, specs or options; the
  tree collectives on the empty tree have the same tree (and no leaves,
  layouts or digests). Only the op tells them apart on the fast path.
  """
  return {
      'sync_global_devices': lambda: multihost.sync_global_devices(''),
      'allgather_object': lambda: multihost.allgather_object(1),
      'broadcast_object': lambda: multihost.broadcast_object(1),
      'process_allgather': lambda: multihost.process_allgather({}),
      'assert_equal': lambda: multihost.assert_equal({}),
      'broadcast_one_to_all(is_source)': lambda: multihost.broadcast_one_to_all(
          {}, is_source=pid == 0),
  }


@topologies
def test_calls_that_differ_only_in_their_op_raise_everywhere(topology):
  # Every process must raise, from the fast path's digest alone: if the op
  # were left out of it, the barrier would pass, and e.g. a process in
  # sync_global_devices('') would return while the others' allgather_object
  # waited for messages it never published.
  pid, count = _me()
  odd = pid == count - 1
  calls = _differ_only_in_op(pid)
  pairs = [('sync_global_devices', 'allgather_object'),
           ('sync_global_devices', 'broadcast_object'),
           ('allgather_object', 'broadcast_object'),
           ('process_allgather', 'assert_equal'),
           ('process_allgather', 'broadcast_one_to_all(is_source)'),
           ('assert_equal', 'broadcast_one_to_all(is_source)')]
  # The job secret is agreed on first use (which waits for every process):
  # agreed here, so that no pair's call outlasts the fast path's window.
  multihost.allgather_object(None)
  wrong = {}  # pair -> what this process got instead (every pair is tried)
  for mine, theirs in pairs:
    for _ in range(10):  # Past the backoff of any fallback: the fast path.
      multihost.sync_global_devices('on time')
    try:
      calls[theirs if odd else mine]()
    except multihost.ConsistencyError as e:
      message = str(e)
      ops = [op.split('(')[0] for op in (mine, theirs)]
      if not ('different collectives' in message and
              all(f"'{op}'" in message for op in ops) and
              f'process [{count - 1}]' in message):
        wrong[mine, theirs] = message
    except multihost.MultihostError as e:
      wrong[mine, theirs] = f'{type(e).__name__}: {e}'
    else:
      wrong[mine, theirs] = 'returned without an error'
  assert not wrong, wrong
  np.testing.assert_array_equal(multihost.process_allgather(np.int32(pid)),
                                np.arange(count))


# tree_digest of _digest_tree(): the same at every topology (also checked at
# 1 process x 4 devices in test_single_process.py).
TOPOLOGY_DIGEST = 'c9ddd7450c5c28ac62c6d249d1550117'


def _digest_tree():
  mesh = jax.make_mesh((jax.device_count(),), ('x',))
  full = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
  sharded = jax.make_array_from_callback(
      full.shape, jax.NamedSharding(mesh, jax.P('x')), lambda i: full[i])
  return {'a': sharded, 'b': np.int32(3)}


@topology_params('2x4', '2x2', '4x1', timeout=GROUP_TIMEOUT_S)
def test_tree_digest_is_the_same_at_every_topology(topology):
  tree = _digest_tree()
  assert not tree['a'].is_fully_addressable
  assert multihost.tree_digest(tree) == TOPOLOGY_DIGEST


@topologies
def test_calls_that_differ_by_process_by_design_take_the_fast_path(topology):
  # Shards of a global array, an explicit source, objects: what differs by
  # process by design is published beside the agreement barrier, so with
  # every process on time no call waits out the 1 s fast-path window.
  pid, count = _me()
  tree = _digest_tree()
  calls = {
      'assert_equal(global)': lambda: multihost.assert_equal(tree),
      'broadcast_one_to_all(is_source)': lambda: multihost.broadcast_one_to_all(
          np.int32(pid), is_source=pid == count - 1),
      'broadcast_object': lambda: multihost.broadcast_object(pid),
      'allgather_object': lambda: multihost.allgather_object(pid),
  }
  for name, call in calls.items():
    for _ in range(10):  # Past the backoff of any fallback: the fast path.
      multihost.sync_global_devices('on time')
    start = time.monotonic()
    call()
    took = time.monotonic() - start
    assert took < 0.8, (name, took)


@topologies
def test_tree_digest_is_topology_independent(topology):
  pid, count = _me()
  mesh = jax.make_mesh((jax.device_count(),), ('x',))
  local, global_array = _global_rows(mesh, pid)
  full = multihost.process_allgather(global_array, tiled=True)
  assert multihost.tree_digest({'a': global_array}) == multihost.tree_digest(
      {'a': full})
  digests = multihost.allgather_object(multihost.tree_digest({'a': full}))
  assert len(set(digests)) == 1
  assert multihost.tree_digest({'a': local}) != multihost.tree_digest(
      {'a': local + 1})


@topologies
def test_preemption_sync_point_without_signal_is_false(topology):
  for step in range(3):
    assert multihost.reached_preemption_sync_point(step) is False
