"""`recovery` consistency checks in 2 real controllers x 2 CPU devices."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import multihost
import recovery


def _state(weights: np.ndarray, *, cursor: int = 0) -> recovery.TransitionState:
  mesh = jax.make_mesh((jax.device_count(),), ('data',))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  # Each process supplies its own copy of a replicated array, as a buggy
  # program with process-dependent values would.
  w = jax.make_array_from_callback(weights.shape, rep, lambda i: weights[i])
  sampler = recovery.EpochSampler(8, 4)
  key, order = sampler.start(jax.random.key(0))
  return recovery.TransitionState(user={'weights': w}, key=key, order=order,
                                  cursor=cursor, epoch=0, step=3)


@pytest.mark.multihost(num_processes=2, devices_per_process=2, timeout=120)
def test_identical_controllers_pass_and_agree_on_the_digest():
  state = _state(np.arange(4, dtype=np.float32))
  digests = recovery.check_consistent(state, what='test')
  everyone = multihost.process_allgather(
      np.frombuffer(bytes.fromhex(recovery.checkpoint_digest(state)), np.uint8))
  assert (everyone == everyone[0]).all()
  assert set(digests) == {'user/weights', 'data/key', 'data/order',
                          'data/cursor', 'data/epoch', 'data/step'}


@pytest.mark.multihost(num_processes=2, devices_per_process=2, timeout=120)
@pytest.mark.parametrize('async_save', [True, False])
def test_divergent_controllers_all_raise_before_saving(multihost_tmp_path,
                                                       async_save):
  # The controllers compare the state before Orbax writes any of it: nothing
  # is written, and the same step saves once they agree.
  pid = jax.process_index()
  state = _state(np.full(4, float(pid), np.float32))
  folder = multihost_tmp_path / 'ckpt'
  with recovery.Checkpoints(folder, async_save=async_save) as ckpt:
    with pytest.raises(multihost.ConsistencyError) as e:
      ckpt.save(state, force=True)
    message = str(e.value)
    assert 'Before saving step 3' in message
    # The differing leaf and the processes are named; equal leaves are not.
    assert 'weights' in message and 'cursor' not in message
    assert '[0]' in message and '[1]' in message
    ckpt.wait()  # the abandoned save reports nothing more
    multihost.sync_global_devices('after-divergent-save')
    assert ckpt.steps() == []  # Nothing was committed,
    assert sorted(p.name for p in folder.iterdir()) == ['.recovery-lock']
    # and the same step saves once the controllers agree.
    same = _state(np.zeros(4, np.float32))
    assert ckpt.save(same, force=True)
    if not async_save:
      assert ckpt.steps() == [3]  # committed before save() returned
    ckpt.wait()
    assert ckpt.steps() == [3]
    assert ckpt.read_meta(3)['digest'] == recovery.checkpoint_digest(same)


@pytest.mark.multihost(num_processes=2, devices_per_process=2, timeout=120)
def test_divergent_data_order_is_named():
  state = _state(np.zeros(4, np.float32), cursor=4 * jax.process_index())
  with pytest.raises(multihost.ConsistencyError, match='cursor'):
    recovery.check_consistent(state, what='After restoring step 3')
  # Cursors 2**40 apart (the same int32 with JAX's x64 off) differ too.
  far = _state(np.zeros(4, np.float32), cursor=4 + 2**40 * jax.process_index())
  with pytest.raises(multihost.ConsistencyError,
                     match='1 of 6 leaves differ') as e:
    recovery.check_consistent(far, what='After restoring step 3')
  assert "['data/cursor']: process [0]: digest" in str(e.value), str(e.value)


@pytest.mark.multihost(num_processes=2, devices_per_process=2, timeout=120)
def test_sharded_leaf_digest_save_and_restore_onto_another_sharding(
    multihost_tmp_path):
  mesh = jax.make_mesh((jax.device_count(),), ('data',))
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  row = jax.sharding.NamedSharding(mesh, P('data'))
  rep = jax.sharding.NamedSharding(mesh, P())
  value = np.arange(8, dtype=np.float32)
  sharded = jax.make_array_from_callback((8,), row, lambda i: value[i])
  assert not sharded.is_fully_addressable
  state = _state(np.zeros(4, np.float32)).replace(
      user={'weights': sharded})
  # The digest is of the global value, whatever the placement.
  assert (recovery.checkpoint_digest(state)
          == recovery.checkpoint_digest(state.replace(user={'weights': value})))
  with recovery.Checkpoints(multihost_tmp_path / 'ckpt') as ckpt:
    assert ckpt.save(state, force=True)
    ckpt.wait()
    zeros = np.zeros(8, np.float32)
    target = state.replace(user={'weights': jax.make_array_from_callback(
        (8,), rep, lambda i: zeros[i])})
    restored = ckpt.restore(target)
  assert restored.user['weights'].sharding == rep
  np.testing.assert_array_equal(
      recovery.host_value(restored.user['weights']), value)
  assert recovery.checkpoint_digest(restored) == recovery.checkpoint_digest(state)


@pytest.mark.multihost(num_processes=2, devices_per_process=2, timeout=120)
def test_sharded_leaf_replicas_on_several_processes_are_compared():
  # Rows of the mesh are processes: P('local') puts each shard on both
  # processes (replicas that must agree), P('hosts') each row on one process.
  devices = np.array(jax.devices()).reshape(jax.process_count(),
                                            jax.local_device_count())
  mesh = jax.sharding.Mesh(devices, ('hosts', 'local'))
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  mine = np.full((4, 4), float(jax.process_index()), np.float32)

  def leaf(spec):
    x = jax.make_array_from_callback(
        (4, 4), jax.sharding.NamedSharding(mesh, spec), lambda i: mine[i])
    assert not x.is_fully_addressable and not x.is_fully_replicated
    return x

  base = _state(np.zeros(4, np.float32))
  # Each process holds its own rows: different values are no divergence.
  recovery.check_consistent(base.replace(user={'rows': leaf(P('hosts'))}),
                            what='rows')
  # Each column is held by both processes, which disagree on it.
  with pytest.raises(multihost.ConsistencyError) as e:
    recovery.check_consistent(
        base.replace(user={'rows': leaf(P('hosts')), 'cols': leaf(P('local'))}),
        what='Before saving step 3')
  assert 'cols' in str(e.value) and 'rows' not in str(e.value)


@pytest.mark.multihost(num_processes=2, devices_per_process=2, timeout=120)
def test_keep_deletes_the_same_steps_on_every_process(multihost_tmp_path):
  # Steps left by an earlier run count toward keep-N: process 0 lists them
  # under the lock and every process deletes the same ones, with no
  # broadcast per save.
  folder = multihost_tmp_path / 'ckpt'
  state = _state(np.zeros(4, np.float32))
  with recovery.Checkpoints(folder, keep=5) as ckpt:
    for step in (1, 2, 3):
      assert ckpt.save(state.replace(step=step), force=True)
    ckpt.wait()
    assert ckpt.steps() == [1, 2, 3]
  with recovery.Checkpoints(folder, keep=2) as ckpt:
    assert ckpt.save(state.replace(step=4), force=True)
    ckpt.wait()
    assert ckpt.steps() == [3, 4]
    assert ckpt.save(state.replace(step=5), force=True)
  multihost.sync_global_devices('keep-closed')
  steps = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())
  everyone = multihost.process_allgather(np.array(steps))
  assert (everyone == [4, 5]).all(), everyone


@pytest.mark.multihost(num_processes=2, devices_per_process=2, timeout=120)
def test_a_locked_folder_is_refused_on_every_process(multihost_tmp_path):
  folder = multihost_tmp_path / 'ckpt'
  with recovery.Checkpoints(folder) as first:
    # Process 0 finds the folder locked (by this very run, through `first`);
    # every process raises the refusal, naming the holder.
    with pytest.raises(recovery.CheckpointError,
                       match=r'in use by another run .*pid '):
      recovery.Checkpoints(folder)
    assert first.save(_state(np.zeros(4, np.float32)), force=True)
  with recovery.Checkpoints(folder) as again:  # free once `first` is closed
    assert again.steps() == [3]


@pytest.mark.multihost(num_processes=2, devices_per_process=2, timeout=120)
def test_every_process_takes_process_0s_resume_decision(multihost_tmp_path):
  folder = multihost_tmp_path / 'ckpt'
  state = _state(np.zeros(4, np.float32))
  saved = os.environ.copy()
  for name in recovery.RESTART_COUNT_VARIABLES:
    os.environ.pop(name, None)
  try:
    with recovery.Checkpoints(folder) as ckpt:
      assert ckpt.start(state, resume='if_present') is state  # empty: fresh
      assert ckpt.resumed_from is None
      assert ckpt.save(state, force=True)
    # Only process 0 sees the requeue: every process follows its decision
    # (a process deciding alone would start fresh and raise, leaving
    # process 0 waiting in the restore).
    if jax.process_index() == 0:
      os.environ['SLURM_RESTART_COUNT'] = '1'
    with recovery.Checkpoints(folder) as ckpt:
      restored = ckpt.start(state)
      assert ckpt.resumed_from == 3
    assert (recovery.checkpoint_digest(restored)
            == recovery.checkpoint_digest(state))
  finally:
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.multihost(num_processes=2, devices_per_process=2, timeout=120)
def test_a_symlinked_step_is_read_and_kept_on_every_process(
    multihost_tmp_path):
  other, run = multihost_tmp_path / 'other', multihost_tmp_path / 'run'
  state = _state(np.zeros(4, np.float32))
  with recovery.Checkpoints(other) as ckpt:
    assert ckpt.save(state, force=True)  # step 3
  multihost.sync_global_devices('other-saved')
  before = sorted(str(p.relative_to(other)) for p in other.rglob('*'))
  if jax.process_index() == 0:
    run.mkdir()
    os.symlink(other / '3', run / '3')
  multihost.sync_global_devices('linked')
  with recovery.Checkpoints(run, keep=1) as ckpt:
    ckpt.start(state, resume=True)
    assert ckpt.resumed_from == 3
    for step in (4, 5, 6):
      assert ckpt.save(state.replace(step=step), force=True)
    ckpt.wait()
    assert ckpt.steps() == [3, 6]
  multihost.sync_global_devices('run-closed')
  names = sorted(p.name for p in run.iterdir())
  everyone = multihost.allgather_object(names)
  assert everyone == [['3', '6']] * jax.process_count(), everyone
  assert os.path.islink(run / '3')
  assert sorted(str(p.relative_to(other)) for p in other.rglob('*')) == before
