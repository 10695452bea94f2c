"""Recovery with the states real training code carries (optax, flax, scalars), in one controller.

A resumed run behaves like the fresh run it continues: every restored leaf
has the target's type, dtype, shape, sharding and commitment, and the
resumed losses equal the uninterrupted run's bitwise. The workloads are in
tests/states_workload.py; here they run in this process (4 devices); the
real-controller runs (2x2, resumed at 1x4 and 4x1) are in
tests/multiprocess/test_states_processes.py.
"""

from __future__ import annotations

import collections
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import states_workload as workload

import multihost
import recovery

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _by_step(losses: dict) -> dict[int, float]:
  return {int(s): v for s, v in losses.items()}


def _after_stop(losses: dict) -> dict[int, float]:
  return {s: v for s, v in _by_step(losses).items() if s > workload.STOP_AT}


# -- one controller ---------------------------------------------------------


@pytest.mark.parametrize('kind', workload.KINDS)
def test_one_controller_resume_is_bitwise_the_uninterrupted_run(
    kind, tmp_path):
  built = workload.build(kind)
  ref = workload.train(kind, None, until=workload.UNTIL, resume=False,
                       built=built)
  first = workload.train(kind, str(tmp_path / 'run'), until=workload.STOP_AT,
                         resume=False, built=built)
  # A new process would build a new target: so does the resume here
  # (train() also checks every restored leaf against it).
  resumed = workload.train(kind, str(tmp_path / 'run'), until=workload.UNTIL,
                           resume=True)
  assert first == {s: v for s, v in ref.items() if s <= workload.STOP_AT}
  assert resumed == _after_stop(ref)


def test_restored_leaves_keep_the_target_kinds(tmp_path):
  """Every kind of leaf, at step 0, restored onto its own fresh target."""
  mesh = jax.make_mesh((4,), ('d',))
  rows = jax.NamedSharding(mesh, jax.P('d'))
  Pair = collections.namedtuple('Pair', ['a', 'b'])
  user = {
      'uncommitted': jnp.arange(3.0),
      'committed': jax.device_put(np.arange(3.0, dtype=np.float32),
                                  jax.devices()[2]),
      'sharded': jax.device_put(np.arange(8, dtype=np.int32), rows),
      'key': jax.random.key(5), 'rbg_keys': jax.random.split(
          jax.random.key(6, impl='rbg'), 3),
      'sharded_keys': jax.device_put(jax.random.split(jax.random.key(7), 4),
                                     rows),
      'int': 7, 'float': 0.25, 'bool': True, 'complex': 1 + 2j,
      'np': np.arange(4, dtype=np.float64), 'np_scalar': np.int16(3),
      'none': None, 'empty': {}, 'empty_list': [], 'pair': Pair(1.5, None),
  }
  state = recovery.TransitionState(user=user, key=jax.random.key(0),
                                   order=np.arange(8, dtype=np.int32),
                                   cursor=0, epoch=0, step=0)
  with recovery.Checkpoints(tmp_path / 'ckpt') as ckpt:
    assert ckpt.save(state, force=True)
    ckpt.wait()
    meta = ckpt.read_meta(0)
    restored = ckpt.restore(state)
  workload.check_like(user, restored.user)
  assert meta['kinds']['user/uncommitted'] == 'uncommitted'
  assert meta['kinds']['user/sharded_keys'] == 'key/committed'
  assert meta['kinds']['user/int'] == 'int'
  assert restored.user['uncommitted'].devices() == {jax.devices()[0]}
  assert restored.user['committed'].devices() == {jax.devices()[2]}
  for name in ('key', 'rbg_keys', 'sharded_keys'):
    assert (jax.random.key_impl(restored.user[name])
            == jax.random.key_impl(user[name]))
  assert recovery.checkpoint_digest(restored) == recovery.checkpoint_digest(state)
  for a, b in zip(jax.tree.leaves(recovery.host_tree(state.to_tree())),
                  jax.tree.leaves(recovery.host_tree(restored.to_tree())),
                  strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_python_int_target_takes_the_saved_int32_step(tmp_path):
  """flax's TrainState starts at step=0 (int) and saves an int32 array."""
  def state(step_leaf):
    return recovery.TransitionState(
        user={'step': step_leaf, 'lr': 0.5}, key=jax.random.key(0),
        order=np.arange(4, dtype=np.int32), cursor=0, epoch=0, step=2)
  with recovery.Checkpoints(tmp_path / 'ckpt') as ckpt:
    ckpt.save(state(jnp.int32(41)), force=True)
    ckpt.wait()
    restored = ckpt.restore(state(0))
    assert restored.user == {'step': 41, 'lr': 0.5}
    assert type(restored.user['step']) is int
    with pytest.raises(recovery.CheckpointError, match='user/step'):
      ckpt.restore(state(0.0))  # An int32 is no float: does not fit.


@pytest.mark.parametrize('leaf, type_name', [
    ('a string', 'builtins.str'), (object(), 'builtins.object'),
    (np.array(['x']), 'numpy.ndarray'), (2 ** 70, 'int64')])
def test_a_leaf_that_cannot_be_checkpointed_fails_the_first_save(
    leaf, type_name, tmp_path):
  state = recovery.TransitionState(
      user={'params': {'w': jnp.zeros(2), 'bad': leaf}},
      key=jax.random.key(0), order=np.arange(4, dtype=np.int32), cursor=0,
      epoch=0, step=0)
  with recovery.Checkpoints(tmp_path / 'ckpt') as ckpt:
    with pytest.raises(recovery.CheckpointError) as e:
      ckpt.save(state, force=True)
    assert 'user/params/bad' in str(e.value) and type_name in str(e.value)
    assert ckpt.steps() == []


def test_old_v1_checkpoints_still_restore(tmp_path):
  """A v1 checkpoint (dicts of arrays) restores; its metadata had no kinds."""
  mesh = jax.make_mesh((4,), ('d',))
  w = jax.device_put(np.arange(8, dtype=np.float32),
                     jax.NamedSharding(mesh, jax.P('d')))
  state = recovery.TransitionState(user={'w': w}, key=jax.random.key(0),
                                   order=np.arange(4, dtype=np.int32),
                                   cursor=1, epoch=0, step=3)
  with recovery.Checkpoints(tmp_path / 'ckpt') as ckpt:
    ckpt.save(state, force=True)
  meta_file = next((tmp_path / 'ckpt' / '3' / 'meta').glob('*'))
  meta = json.loads(meta_file.read_text())
  meta['format'] = 'recovery-checkpoint-v1'
  del meta['kinds']
  meta_file.write_text(json.dumps(meta))
  with recovery.Checkpoints(tmp_path / 'ckpt', read_only=True) as ckpt:
    restored = ckpt.restore(state)
  assert restored.user['w'].sharding == w.sharding
  assert recovery.checkpoint_digest(restored) == recovery.checkpoint_digest(state)


def test_multihost_digests_accept_the_same_trees():
  """multihost.tree_digest/assert_equal take every workload's raw state."""
  for kind in workload.KINDS:
    _, initial = workload.build(kind)
    multihost.assert_equal(initial.user, kind)
    assert len(multihost.tree_digest(initial.user)) == 32
    assert multihost.leaf_digests(initial.user)


# -- several controllers: 2x2, resumed at 2x2, 1x4 and 4x1 ---------------------


