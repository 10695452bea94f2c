"""The local checkpoint tier: atomic per-process steps, peer copies, restores.

Single-process tests (4 virtual devices) check the folder format, keep-N, the
choice between the tiers, the fallbacks and the folder's safety (owner-only,
never through a link, steps owned by their run). The SIGKILL drills with real
controllers are in tests/multiprocess/test_local_tier_processes.py.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multihost import env as env_lib
import recovery
from recovery._src.local import folder
from recovery._src.local import layout
from recovery._src.local import private

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / 'bin' / 'train.py')
PY = sys.executable
WIDTH = 8
SAMPLES = 12
BATCH = 4


# -- a small model, sharded or replicated over this process's 4 devices ------


def _loop(sharding) -> recovery.ResilientLoop:
  rng = np.random.default_rng(0)
  data = rng.normal(size=(SAMPLES, WIDTH)).astype(np.float32)
  targets = data @ np.linspace(-1, 1, WIDTH, dtype=np.float32)
  rep = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())

  def step(user, batch):
    x, y = batch
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y)**2))(
        user['w'])
    v = 0.8 * user['v'] + g
    return {'w': user['w'] - 0.05 * v, 'v': v}, loss

  step_fn = jax.jit(step, out_shardings=({'w': sharding, 'v': sharding}, rep))

  def data_fn(ids):
    return (jax.device_put(data[ids], rep), jax.device_put(targets[ids], rep))

  return recovery.ResilientLoop(
      step_fn, data_fn=data_fn, sampler=recovery.EpochSampler(SAMPLES, BATCH))


def _sharded(devices=None):
  mesh = jax.make_mesh((len(devices or jax.devices()),), ('data',),
                       devices=devices)
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))


def _initial(loop, sharding, dtype=np.float32) -> recovery.TransitionState:
  zeros = jnp.zeros(WIDTH, dtype)
  return loop.init({'w': jax.device_put(zeros, sharding),
                    'v': jax.device_put(zeros, sharding)}, jax.random.key(3))


def _train(tmp_path, steps, *, save_every=100, local_every=3, sharding=None,
           restart=False, monkeypatch=None, local='local', local_keep=2,
           dtype=np.float32, resume=None):
  """Runs `steps` steps (resuming on `restart`); returns (state, checkpoints).

  `dtype`: the weights' (a config mistake when it differs from the saved
  one); `resume`: `start`'s mode.
  """
  sharding = sharding or _sharded()
  loop = _loop(sharding)
  initial = _initial(loop, sharding, dtype)
  if monkeypatch is not None:
    if restart:
      monkeypatch.setenv('MULTIHOST_RESTART_COUNT', '1')
    else:
      monkeypatch.delenv('MULTIHOST_RESTART_COUNT', raising=False)
  with recovery.Checkpoints(tmp_path / 'ckpt', save_every=save_every,
                            async_save=False,
                            local_directory=tmp_path / local,
                            local_save_every=local_every,
                            local_keep=local_keep) as ckpt:
    state = ckpt.start(initial, resume=resume)
    result = loop.run(state, until_step=steps, checkpoints=ckpt)
  return result.state, ckpt


def _delete_persistent(tmp_path, step):
  shutil.rmtree(tmp_path / 'ckpt' / str(step))


def _step_folder(local, step, process=0) -> pathlib.Path:
  """The committed folder of local `step` in `local`'s `process_<process>`."""
  (found,) = [p for p in (local / f'process_{process}').iterdir()
              if '.tmp-' not in p.name and p.name.split('-')[0] == str(step)]
  return found


def _stored(local) -> set[tuple[str, int]]:
  """{(checkpoint folder, step)} of the committed local steps in `local`."""
  return {(s.manifest['directory'], s.step) for s in folder.scan(str(local))}


# -- the folder format --------------------------------------------------------


RUN = '0123456789abcdef'  # a run identity (run_identity.new())
OTHER_RUN = 'fedcba9876543210'


def test_a_write_killed_midway_and_an_uncommitted_folder_are_not_steps(
    tmp_path):
  block = (('w', ((0, 4),)), np.arange(4, dtype=np.float32))
  folder.write_step(str(tmp_path), 0, 5,
                    {'run': RUN, 'meta': {'digest': 'a'}}, [block])
  own = tmp_path / 'process_0'
  # A write killed before its rename: a temporary folder with data only.
  (own / f'7-{RUN}.tmp-dead').mkdir()
  (own / f'7-{RUN}.tmp-dead' / 'data.bin').write_bytes(b'x' * 16)
  # A complete-looking folder without its commit marker.
  (own / f'8-{RUN}').mkdir()
  for name in ('manifest.json', 'data.bin'):
    (own / f'8-{RUN}' / name).write_bytes(
        (own / f'5-{RUN}' / name).read_bytes())
  stored = folder.scan(str(tmp_path))
  assert [s.step for s in stored] == [5]
  np.testing.assert_array_equal(
      folder.read_block(stored[0].entries[block[0]]), block[1])
  # A truncated data file makes the step unusable, not garbage.
  with open(own / f'5-{RUN}' / 'data.bin', 'r+b') as f:
    f.truncate(8)
  assert folder.scan(str(tmp_path)) == []
  (own / f'7-{OTHER_RUN}.tmp-0a1b').mkdir()  # another run's write, now
  folder.remove_tmp(str(tmp_path), 0, RUN)
  assert not (own / f'7-{RUN}.tmp-dead').exists()
  assert (own / f'7-{OTHER_RUN}.tmp-0a1b').is_dir()


@pytest.mark.parametrize('swap', ['exchange', 'three renames'])
def test_a_replaced_step_always_has_a_complete_copy(tmp_path, monkeypatch,
                                                    swap):
  # The same step of the same run written again (a restarted run). At each
  # rename and removal step 5 is complete on disk, old or new: under its own
  # name where the filesystem swaps two folders at once (renameat2), else
  # under its name or a committed write's (which the next start puts back
  # in place: the test below).
  if swap == 'three renames':
    monkeypatch.setattr(private, 'exchange', lambda a, b: False)
  local, own = str(tmp_path), str(tmp_path / 'process_0')
  old = (('w', ((0, 4),)), np.arange(4, dtype=np.float32))
  new = (('w', ((0, 4),)), np.arange(4, 8, dtype=np.float32))
  folder.write_step(local, 0, 5, {'run': RUN, 'meta': {'digest': 'a'}}, [old])
  seen = []

  def readable(what):
    names = [n for n in sorted(os.listdir(own)) if n == f'5-{RUN}' or (
        swap == 'three renames' and n.startswith(f'5-{RUN}.tmp-'))]
    complete = [c for c in (folder._read(os.path.join(own, n), 5, RUN, 0)
                            for n in names) if c is not None]
    assert complete, f'no complete step 5 on disk after {what}: {names}'
    seen.append(float(folder.read_block(complete[0].entries[old[0]])[0]))

  for module, name in ((os, 'rename'), (shutil, 'rmtree')):
    real = getattr(module, name)

    def watched(*args, real=real, name=name, **kwargs):
      readable(f'before {name}{args}')
      out = real(*args, **kwargs)
      readable(f'{name}{args}')
      return out

    monkeypatch.setattr(module, name, watched)
  folder.write_step(local, 0, 5, {'run': RUN, 'meta': {'digest': 'b'}}, [new])
  monkeypatch.undo()
  assert seen and set(seen) <= {0.0, 4.0} and seen[-1] == 4.0, seen
  (stored,) = folder.scan(local)
  np.testing.assert_array_equal(
      folder.read_block(stored.entries[new[0]]), new[1])
  assert os.listdir(own) == [f'5-{RUN}']


def test_a_replacement_killed_between_renames_keeps_the_newer_copy(tmp_path):
  # Both copies complete under names of the run's writes, the step's own
  # name gone (killed between the fallback's first two renames).
  local = str(tmp_path)
  own = tmp_path / 'process_0'
  for digest, values in (('old', [0.0]), ('new', [1.0])):
    folder.write_step(local, 0, 5, {'run': RUN, 'meta': {'digest': digest}},
                      [(('w', ((0, 1),)), np.asarray(values, np.float32))])
    os.rename(own / f'5-{RUN}', own / f'5-{RUN}.tmp-ab{"0" * (digest == "old")}')
  folder.remove_tmp(local, 0, RUN)
  (stored,) = folder.scan(local)
  assert stored.manifest['meta']['digest'] == 'new'
  assert os.listdir(own) == [f'5-{RUN}']


def test_a_0d_block_keeps_its_shape(tmp_path):
  folder.write_step(str(tmp_path), 2, 1,
                    {'run': RUN, 'meta': {'digest': 'a'}},
                    [(('step', ()), np.asarray(7, np.int64))])
  (stored,) = folder.scan(str(tmp_path))
  assert folder.read_block(stored.entries[('step', ())]).shape == ()


def test_prune_ranks_and_deletes_only_this_run_s_real_step_folders(tmp_path):
  block = [(('w', ()), np.zeros(2, np.float32))]

  def write(run, step):
    folder.write_step(str(tmp_path), 0, step,
                      {'run': run, 'meta': {'digest': 'a'}}, block)

  for run, step in ((OTHER_RUN, 1), (OTHER_RUN, 9), (RUN, 2), (RUN, 3),
                    (RUN, 8)):
    write(run, step)
  own = tmp_path / 'process_0'
  for run in (RUN, OTHER_RUN):  # writes killed mid-way
    (own / f'6-{run}.tmp-0a0b').mkdir()
  elsewhere = tmp_path / 'elsewhere'  # a link named as one of its steps
  (elsewhere / 'x').mkdir(parents=True)
  (own / f'4-{RUN}').symlink_to(elsewhere)
  write(RUN, 5)
  # Step 5 was just written; the run went back from step 8 (newer); keep=2
  # keeps step 3 too. The link is neither ranked nor followed.
  assert folder.prune(str(tmp_path), 0, RUN, keep=2, written=5) == [2, 8]
  assert sorted(p.name for p in own.iterdir()) == sorted([
      f'1-{OTHER_RUN}', f'9-{OTHER_RUN}', f'6-{OTHER_RUN}.tmp-0a0b',
      f'3-{RUN}', f'4-{RUN}', f'5-{RUN}'])
  assert (elsewhere / 'x').is_dir()
  assert sorted((s.run, s.step) for s in folder.scan(str(tmp_path))) == [
      (RUN, 3), (RUN, 5), (OTHER_RUN, 1), (OTHER_RUN, 9)]


# -- saving, keep-N and the choice of tier ------------------------------------


def test_local_steps_are_saved_on_their_own_schedule_and_pruned(
    tmp_path, monkeypatch):
  _train(tmp_path, 10, save_every=100, local_every=3, monkeypatch=monkeypatch)
  local = tmp_path / 'local' / 'process_0'
  assert sorted(int(p.name.split('-')[0]) for p in local.iterdir()) == [6, 9]
  assert sorted(int(p.name) for p in (tmp_path / 'ckpt').iterdir()
                if p.name.isdigit()) == [10]


def test_a_restart_takes_the_newer_tier_and_ends_like_the_uninterrupted_run(
    tmp_path, monkeypatch):
  reference, _ = _train(tmp_path / 'ref', 14, monkeypatch=monkeypatch)
  _train(tmp_path, 11, save_every=4, local_every=3, monkeypatch=monkeypatch)
  _delete_persistent(tmp_path, 11)  # The final save: as if killed after 11.
  # Local step 9 is newer than persistent step 8.
  state, ckpt = _train(tmp_path, 14, save_every=4, restart=True,
                       monkeypatch=monkeypatch)
  assert (ckpt.resumed_from, ckpt.resumed_tier) == (9, 'local')
  assert (recovery.checkpoint_digest(state)
          == recovery.checkpoint_digest(reference))
  # Persistent step 14 is newer than local step 12.
  _, ckpt = _train(tmp_path, 14, save_every=4, restart=True,
                   monkeypatch=monkeypatch)
  assert (ckpt.resumed_from, ckpt.resumed_tier) == (14, 'persistent')


def test_a_damaged_local_step_falls_back_to_the_persistent_tier(
    tmp_path, monkeypatch, caplog):
  _train(tmp_path, 11, save_every=4, local_every=3, monkeypatch=monkeypatch)
  _delete_persistent(tmp_path, 11)
  for step in (6, 9):
    data = _step_folder(tmp_path / 'local', step) / 'data.bin'
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xff  # a flipped bit in the last leaf's bytes
    data.write_bytes(bytes(raw))
  _, ckpt = _train(tmp_path, 12, save_every=4, restart=True,
                   monkeypatch=monkeypatch)
  assert (ckpt.resumed_from, ckpt.resumed_tier) == (8, 'persistent')
  assert 'failed its digest check' in caplog.text


def _flip_last_byte(tmp_path, step):
  data = _step_folder(tmp_path / 'local', step) / 'data.bin'
  raw = bytearray(data.read_bytes())
  raw[-1] ^= 0xff
  data.write_bytes(bytes(raw))


@pytest.mark.parametrize('damage', ['digest', 'incomplete'])
def test_a_damaged_newest_local_step_restores_the_older_local_one(
    tmp_path, monkeypatch, caplog, damage):
  reference, _ = _train(tmp_path / 'ref', 14, monkeypatch=monkeypatch)
  _train(tmp_path, 11, save_every=5, local_every=3, monkeypatch=monkeypatch)
  for step in (10, 11):  # As if killed after step 9: persistent step 5.
    _delete_persistent(tmp_path, step)
  if damage == 'digest':
    _flip_last_byte(tmp_path, 9)
  else:  # Its commit marker gone: a write killed before its rename.
    (_step_folder(tmp_path / 'local', 9) / 'COMMIT').unlink()
  caplog.set_level('INFO')
  state, ckpt = _train(tmp_path, 14, save_every=5, restart=True,
                       monkeypatch=monkeypatch)
  assert (ckpt.resumed_from, ckpt.resumed_tier) == (6, 'local')
  assert (recovery.checkpoint_digest(state)
          == recovery.checkpoint_digest(reference))
  local = str(tmp_path / 'local')
  newest = 9 if damage == 'digest' else 6
  assert f'Resuming from local step {newest} in {local}' in caplog.text
  if damage == 'digest':
    # Set aside, kept: past the run's later saves of steps 9 and 12.
    (aside,) = ckpt.set_aside
    assert (aside.step, aside.tier) == (9, 'local')
    moved = aside.path
    assert re.fullmatch(r'9-[0-9a-f]{16}\.damaged-\d{8}T\d{6}Z',
                        os.path.basename(moved)), moved
    assert os.path.isdir(moved) and os.path.dirname(moved) == os.path.join(
        local, 'process_0'), moved
    assert (f"Local step 9 failed its checks; set this process's folder of "
            f'it aside as {moved} (kept, never read or deleted); resuming '
            'from local step 6 instead') in caplog.text
  assert re.search(rf'Restored local step 6 .* from the local tier in {local}'
                   r' in [\d.]+ s; 0 bytes came from peers', caplog.text)


def test_a_local_step_equal_to_the_newest_persistent_one_takes_the_local_tier(
    tmp_path, monkeypatch):
  """A local step equal to the newest persistent step wins the tie: the restore reads the local tier."""
  _train(tmp_path, 12, save_every=4, local_every=3, monkeypatch=monkeypatch)
  # Local steps 9 and 12; persistent steps 4, 8 and 12 (the final save).
  state, ckpt = _train(tmp_path, 12, save_every=4, restart=True,
                       monkeypatch=monkeypatch)
  assert (ckpt.resumed_from, ckpt.resumed_tier) == (12, 'local')
  assert state.step == 12


def test_a_damaged_local_step_falls_back_to_an_older_local_step_equal_to_the_persistent_one(
    tmp_path, monkeypatch, caplog):
  """Past a damaged newer local step, the older local step equal to the newest persistent one restores from the local tier."""
  reference, _ = _train(tmp_path / 'ref', 12, monkeypatch=monkeypatch)
  _train(tmp_path, 9, save_every=6, local_every=3, monkeypatch=monkeypatch)
  _delete_persistent(tmp_path, 9)  # As if killed after step 9: persistent 6.
  _flip_last_byte(tmp_path, 9)  # Local steps 6 and 9; 9 fails its digest.
  caplog.set_level('INFO')
  state, ckpt = _train(tmp_path, 12, save_every=6, restart=True,
                       monkeypatch=monkeypatch)
  assert (ckpt.resumed_from, ckpt.resumed_tier) == (6, 'local')
  assert re.search(r"Local step 9 failed its checks; set this process's "
                   r'folder of it aside as .*9-[0-9a-f]{16}\.damaged-.*; '
                   'resuming from local step 6 instead', caplog.text)
  assert (recovery.checkpoint_digest(state)
          == recovery.checkpoint_digest(reference))


def test_damaged_local_and_persistent_steps_fall_back_to_an_older_local_one(
    tmp_path, monkeypatch, caplog):
  """Past damaged local step 9 and persistent steps 9 and 8, local step 6 restores; all three are set aside, each in the record with its tier."""
  reference, _ = _train(tmp_path / 'ref', 12, monkeypatch=monkeypatch)
  _train(tmp_path, 9, save_every=4, local_every=3, local_keep=3,
         monkeypatch=monkeypatch)  # persistent 4, 8, 9; local 3, 6, 9
  _flip_last_byte(tmp_path, 9)
  for step in (8, 9):
    for f in (tmp_path / 'ckpt' / str(step) / 'state').rglob('*'):
      if f.is_file() and f.parent.name == 'd':
        f.write_bytes(np.random.default_rng(step).bytes(f.stat().st_size))
  caplog.set_level('INFO')
  state, ckpt = _train(tmp_path, 12, save_every=4, local_every=3,
                       local_keep=3, restart=True, monkeypatch=monkeypatch)
  assert (ckpt.resumed_from, ckpt.resumed_tier) == (6, 'local')
  # Both step 9s: the local one first (tried first), then the persistent.
  assert [(a.step, a.tier) for a in ckpt.set_aside] == [
      (9, 'local'), (9, 'persistent'), (8, 'persistent')], ckpt.set_aside
  renamed = sorted(str(p) for d in (tmp_path / 'ckpt',
                                    tmp_path / 'local' / 'process_0')
                   for p in d.iterdir() if '.damaged-' in p.name)
  assert sorted(a.path for a in ckpt.set_aside) == renamed
  lines = [r.getMessage() for r in caplog.records
           if 'Set it aside as' in r.getMessage()]
  assert len(lines) == 2, lines
  for step, line in zip((9, 8), lines):
    assert re.search(rf'Checkpoint step {step} in .* is damaged: its files '
                     rf'cannot be read .*Set it aside as .*/{step}\.damaged-'
                     r'.*; resuming from local step 6 instead\.', line), line
  assert re.search(r"Local step 9 failed its checks; set this process's "
                   r'folder of it aside as .*9-[0-9a-f]{16}\.damaged-.*; '
                   'resuming from local step 6 instead', caplog.text)
  # Step 8 was saved again; the damaged folders are kept beside it.
  assert ckpt.steps() == [4, 8, 12]
  names = sorted(os.listdir(tmp_path / 'ckpt'))
  assert [n.split('.damaged-')[0] for n in names if '.damaged-' in n] == [
      '8', '9'], names
  assert (recovery.checkpoint_digest(state)
          == recovery.checkpoint_digest(reference))


@pytest.mark.parametrize('devices', [
    pytest.param(lambda d: d[:2], id='fewer-devices'),
    pytest.param(lambda d: d[::-1], id='same-blocks-other-devices')])
def test_another_topology_takes_the_persistent_tier(tmp_path, monkeypatch,
                                                     devices):
  _train(tmp_path, 11, save_every=4, local_every=3, monkeypatch=monkeypatch)
  _delete_persistent(tmp_path, 11)
  _, ckpt = _train(tmp_path, 12, save_every=4, restart=True,
                   sharding=_sharded(devices(jax.devices())),
                   monkeypatch=monkeypatch)
  assert (ckpt.resumed_from, ckpt.resumed_tier) == (8, 'persistent')


def test_a_fresh_start_refuses_local_steps_of_an_earlier_run_of_its_folder(
    tmp_path, monkeypatch):
  """The run marker gone (the folder emptied by hand, or lost): the local steps belong to no run this start can resume, and are still refused."""
  _train(tmp_path, 7, local_every=3, monkeypatch=monkeypatch)
  shutil.rmtree(tmp_path / 'ckpt')
  (tmp_path / 'ckpt').mkdir()
  stored = _stored(tmp_path / 'local')
  ckpt = str(tmp_path / 'ckpt')
  assert stored == {(ckpt, 3), (ckpt, 6)}
  with pytest.raises(recovery.FolderNotFreshError) as e:
    _train(tmp_path, 2, local_every=3, monkeypatch=monkeypatch, resume=False)
  message = str(e.value)
  assert f'local steps [3, 6] of {ckpt}' in message, message
  assert 'of an earlier run of the folder, which no resume restores' in (
      message), message
  assert _stored(tmp_path / 'local') == stored  # nothing deleted


@pytest.mark.parametrize('resume', [None, False])
def test_a_fresh_start_refuses_local_steps_of_its_folder_and_keeps_them(
    tmp_path, monkeypatch, resume):
  """A job that crashed before its first persistent save, started again by hand: its local steps are checkpoints of the folder too."""
  _train(tmp_path, 7, local_every=3, monkeypatch=monkeypatch)
  _delete_persistent(tmp_path, 7)
  other = tmp_path / 'other'
  _train(other, 4, local_every=3, monkeypatch=monkeypatch, local='../local')
  stored = _stored(tmp_path / 'local')
  ckpt, local = str(tmp_path / 'ckpt'), str(tmp_path / 'local')
  assert stored == {(ckpt, 3), (ckpt, 6), (str(other / 'ckpt'), 3)}
  with pytest.raises(recovery.FolderNotFreshError) as e:
    _train(tmp_path, 2, local_every=3, monkeypatch=monkeypatch, resume=resume)
  message = str(e.value)
  assert f'local steps [3, 6] of {ckpt}' in message, message
  assert os.path.join(local, 'process_0') in message, message
  assert 'resume=True' in message and 'delete' in message, message
  assert _stored(tmp_path / 'local') == stored  # nothing deleted
  # Continuing is one way; deleting them (the explicit request) the other.
  _, run = _train(tmp_path, 7, local_every=3, monkeypatch=monkeypatch,
                  resume='if_present')
  assert (run.resumed_from, run.resumed_tier) == (6, 'local')
  _delete_persistent(tmp_path, 7)
  for s in folder.scan(local):
    if s.manifest['directory'] == ckpt:
      shutil.rmtree(s.folder)
  _, run = _train(tmp_path, 2, local_every=3, monkeypatch=monkeypatch,
                  resume=resume)
  assert run.resumed_from is None
  assert _stored(tmp_path / 'local') == {(str(other / 'ckpt'), 3)}


def _names(tmp_path) -> dict[str, list[str]]:
  """The entries of the checkpoint folder and of process 0's local folder."""
  return {d: sorted(n for n in os.listdir(tmp_path / d) if '.lock' not in n)
          for d in ('ckpt', 'local/process_0')}


@pytest.mark.parametrize('restart', [True, False], ids=['restart',
                                                        'resume-true'])
def test_a_restart_with_the_wrong_state_raises_a_mismatch_and_moves_nothing(
    tmp_path, monkeypatch, restart):
  """A config mistake (bfloat16 weights where float32 were saved) is no damage: every tier's steps stay, and the fixed restart resumes the newest."""
  _train(tmp_path, 6, save_every=5, local_every=3, monkeypatch=monkeypatch)
  _delete_persistent(tmp_path, 6)  # persistent step 5; local steps 3 and 6
  before = _names(tmp_path)
  resume = None if restart else True
  with pytest.raises(recovery.CheckpointMismatchError,
                     match=r'user/w: checkpoint has .*float32.*bfloat16'):
    _train(tmp_path, 8, save_every=5, dtype=jnp.bfloat16, restart=restart,
           resume=resume, monkeypatch=monkeypatch)
  assert _names(tmp_path) == before
  state, ckpt = _train(tmp_path, 8, save_every=5, restart=restart,
                       resume=resume, monkeypatch=monkeypatch)
  assert (ckpt.resumed_from, ckpt.resumed_tier) == (6, 'local')
  assert ckpt.set_aside == [] and state.step == 8


def test_a_strict_resume_refuses_a_damaged_local_step_and_moves_nothing(
    tmp_path, monkeypatch):
  """resume=True started by hand: a person asked for the newest step; a damaged one is refused, not passed over (nor renamed)."""
  _train(tmp_path, 11, save_every=5, local_every=3, monkeypatch=monkeypatch)
  for step in (10, 11):
    _delete_persistent(tmp_path, step)  # persistent 5; local 6 and 9
  _flip_last_byte(tmp_path, 9)
  before = _names(tmp_path)
  with pytest.raises(recovery.CheckpointDamagedError,
                     match=r"Local step 9 in .* is damaged: it failed its "
                     r"digest check.*Start with resume='if_present'"):
    _train(tmp_path, 12, save_every=5, resume=True, monkeypatch=monkeypatch)
  assert _names(tmp_path) == before
  _, ckpt = _train(tmp_path, 12, save_every=5, resume='if_present',
                   monkeypatch=monkeypatch)
  assert (ckpt.resumed_from, ckpt.resumed_tier) == (6, 'local')
  assert [(a.step, a.tier) for a in ckpt.set_aside] == [(9, 'local')]


def test_folder_names_that_are_not_steps_are_foreign_and_left_alone(
    tmp_path, monkeypatch, caplog):
  """A step folder's name is ASCII digits equal to str(int(name)): '0900' (a person's copy of a step) or non-ASCII digits are foreign, in both tiers."""
  _train(tmp_path, 6, save_every=2, local_every=3, monkeypatch=monkeypatch)
  ckpt = tmp_path / 'ckpt'
  for name in ('0900', '\u0669\u0660\u0660'):  # '0900', Arabic-Indic '900'
    shutil.copytree(ckpt / '2', ckpt / name)
  (ckpt / '0900.orbax-checkpoint-tmp-1').mkdir()  # no save's leftover
  six = _step_folder(tmp_path / 'local', 6)
  run = six.name.split('-', 1)[1]
  own = tmp_path / 'local' / 'process_0'
  for name in (f'09-{run}', f'\u0669-{run}', f'06-{run}'):
    shutil.copytree(six, own / name)
  foreign = {d: [n for n in names if n[0] in '0\u0669']
             for d, names in _names(tmp_path).items()}
  for _ in range(2):  # Each restart resumes the newest step; keep-N runs.
    _, run_ = _train(tmp_path, 12, save_every=2, local_every=3, restart=True,
                     monkeypatch=monkeypatch)
    assert (run_.resumed_from, run_.resumed_tier) in [(6, 'local'),
                                                      (12, 'local')]
    assert run_.set_aside == []
    assert {d: [n for n in names if n[0] in '0\u0669']
            for d, names in _names(tmp_path).items()} == foreign
  assert run_.steps() == [8, 10, 12]
  assert "'0900'" in caplog.text  # named as foreign
def test_local_options_are_checked(tmp_path):
  with pytest.raises(ValueError, match='local_save_every=3 needs'):
    recovery.Checkpoints(tmp_path, local_save_every=3)
  with pytest.raises(ValueError, match='local_save_every and local_keep'):
    recovery.Checkpoints(tmp_path / 'a', local_directory=tmp_path / 'l',
                         local_save_every=0)


# -- the folder is this user's and this run's (issue 36) ----------------------


def test_a_process_folder_that_is_a_link_is_refused_never_followed(
    tmp_path, monkeypatch):
  # process_0 links to a folder of digit-named steps (a persistent
  # checkpoint folder, say): nothing in it may be written or deleted.
  elsewhere = tmp_path / 'persistent'
  for step in (100, 200, 300):
    (elsewhere / str(step)).mkdir(parents=True)
  local = tmp_path / 'local'
  local.mkdir(mode=0o700)
  (local / 'process_0').symlink_to(elsewhere)
  error = None
  try:
    _train(tmp_path, 4, local_every=3, monkeypatch=monkeypatch)
  except recovery.CheckpointFolderError as e:
    error = str(e)
  assert sorted(p.name for p in elsewhere.iterdir()) == ['100', '200', '300']
  assert error is not None and str(local / 'process_0') in error, error
  assert 'symlink' in error, error


def test_the_local_folder_is_private_and_a_shared_one_is_refused(
    tmp_path, monkeypatch):
  _train(tmp_path, 4, local_every=3, monkeypatch=monkeypatch)
  for made in (tmp_path / 'local', tmp_path / 'local' / 'process_0'):
    assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
  shared = tmp_path / 'shared'
  shared.mkdir()
  shared.chmod(0o777)
  with pytest.raises(recovery.CheckpointFolderError,
                     match=r'shared .*writable by its group or others'):
    _train(tmp_path / 'b', 4, monkeypatch=monkeypatch, local='../shared')
  assert not (shared / 'process_0').exists()
  # Writable by its group only (0770): another user of the group could
  # plant or swap local steps just as well.
  group = tmp_path / 'group'
  group.mkdir()
  group.chmod(0o770)
  with pytest.raises(recovery.CheckpointFolderError,
                     match=r'group .*writable by its group or others'):
    _train(tmp_path / 'g', 4, monkeypatch=monkeypatch, local='../group')
  assert not (group / 'process_0').exists()
  if os.geteuid() == 0:  # Another user's folder (root can make one).
    theirs = tmp_path / 'theirs'
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(recovery.CheckpointFolderError,
                       match=r'theirs is owned by uid 65534'):
      _train(tmp_path / 'c', 4, monkeypatch=monkeypatch, local='../theirs')


@pytest.mark.parametrize('planted', ['earlier-run', 'other-folder'])
def test_a_step_this_run_did_not_write_is_never_restored(
    tmp_path, monkeypatch, planted):
  # Run 1 of the folder leaves local step 9 where run 2's fresh start does
  # not reach it (another host's folder; here another local folder).
  _train(tmp_path, 11, local_every=3, monkeypatch=monkeypatch, local='old')
  shutil.rmtree(tmp_path / 'ckpt')
  _train(tmp_path, 4, local_every=3, monkeypatch=monkeypatch)
  _delete_persistent(tmp_path, 4)  # run 2: local step 3, nothing persistent
  if planted == 'earlier-run':  # Its own folder, its own self-consistent digest.
    step = _step_folder(tmp_path / 'old', 9)
    shutil.copytree(step, tmp_path / 'local' / 'process_0' / step.name)
  else:  # Another run's step, its manifest made to name this folder.
    _train(tmp_path / 'other', 9, local_every=3, monkeypatch=monkeypatch)
    step = _step_folder(tmp_path / 'other' / 'local', 9)
    copy = tmp_path / 'local' / 'process_0' / step.name
    shutil.copytree(step, copy)
    manifest = json.loads((copy / 'manifest.json').read_text())
    manifest['directory'] = str(tmp_path / 'ckpt')
    (copy / 'manifest.json').write_text(json.dumps(manifest))
  assert (str(tmp_path / 'ckpt'), 9) in _stored(tmp_path / 'local')
  _, ckpt = _train(tmp_path, 6, restart=True, monkeypatch=monkeypatch)
  assert (ckpt.resumed_from, ckpt.resumed_tier) == (3, 'local')


def test_a_local_save_writes_the_state_as_it_was_when_save_returned(
    tmp_path, monkeypatch):
  release = threading.Event()
  write_step = folder.write_step

  def delayed(*args, **kwargs):  # The writer runs after the update below.
    release.wait(60)
    return write_step(*args, **kwargs)

  monkeypatch.setattr(folder, 'write_step', delayed)
  saved = np.arange(8, dtype=np.float32)
  state = recovery.TransitionState(
      user={'w': saved.copy()}, key=jax.random.key(0),
      order=np.arange(4, dtype=np.int32), cursor=0, epoch=0, step=3)

  def checkpoints():
    return recovery.Checkpoints(tmp_path / 'ckpt', save_every=100,
                                async_save=False,
                                local_directory=tmp_path / 'local',
                                local_save_every=3)

  monkeypatch.delenv('MULTIHOST_RESTART_COUNT', raising=False)
  with checkpoints() as ckpt:
    ckpt.start(state.replace(step=0))
    ckpt.save(state)  # local step 3; its files are written in the background
    state.user['w'] += 100  # the next step updates the state in place
    release.set()
  monkeypatch.setenv('MULTIHOST_RESTART_COUNT', '1')
  with checkpoints() as ckpt:
    restored = ckpt.start(
        state.replace(user={'w': np.zeros(8, np.float32)}, step=0))
  assert (ckpt.resumed_from, ckpt.resumed_tier) == (3, 'local')
  np.testing.assert_array_equal(restored.user['w'], saved)


def test_two_runs_sharing_a_local_folder_keep_their_own_steps(
    tmp_path, monkeypatch):
  a, b = tmp_path / 'a', tmp_path / 'b'
  _train(a, 20, local_every=5, monkeypatch=monkeypatch, local='../local')
  _train(b, 5, local_every=5, monkeypatch=monkeypatch, local='../local')
  assert (str(b / 'ckpt'), 5) in _stored(tmp_path / 'local')
  _train(b, 20, local_every=5, restart=True, monkeypatch=monkeypatch,
         local='../local')
  assert _stored(tmp_path / 'local') == {
      (str(run / 'ckpt'), step) for run in (a, b) for step in (15, 20)}
  _delete_persistent(a, 20)
  _, ckpt = _train(a, 20, local_every=5, restart=True,
                   monkeypatch=monkeypatch, local='../local')
  assert (ckpt.resumed_from, ckpt.resumed_tier) == (20, 'local')


def test_keep_1_keeps_the_step_just_written_past_a_newer_failed_one(
    tmp_path, monkeypatch):
  _train(tmp_path, 13, save_every=5, local_every=4, local_keep=1,
         monkeypatch=monkeypatch)
  _delete_persistent(tmp_path, 13)
  _flip_last_byte(tmp_path, 12)  # fails its check: the restart takes 10
  _, ckpt = _train(tmp_path, 11, save_every=5, local_every=11, local_keep=1,
                   restart=True, monkeypatch=monkeypatch)
  assert (ckpt.resumed_from, ckpt.resumed_tier) == (10, 'persistent')
  assert _stored(tmp_path / 'local') == {(str(tmp_path / 'ckpt'), 11)}


def test_a_start_leaves_another_run_s_write_in_progress_alone(
    tmp_path, monkeypatch):
  own = tmp_path / 'local' / 'process_0'
  own.mkdir(parents=True, mode=0o700)
  theirs = own / '7-0123456789abcdef.tmp-0a1b2c3d'  # another run's step 7
  theirs.mkdir()
  (theirs / 'data.bin').write_bytes(b'x' * 16)
  _train(tmp_path, 4, local_every=3, monkeypatch=monkeypatch)
  assert (theirs / 'data.bin').read_bytes() == b'x' * 16


def test_a_failed_local_write_leaves_no_temporary_folder(
    tmp_path, monkeypatch, caplog):
  write_step = folder.write_step

  def disk_full(local, process, step, manifest, blocks):
    def some():
      yield blocks[0]
      raise OSError(errno.ENOSPC, 'No space left on device')
    return write_step(local, process, step, manifest, some())

  monkeypatch.setattr(folder, 'write_step', disk_full)
  _train(tmp_path, 4, local_every=3, monkeypatch=monkeypatch)
  assert 'A local save to' in caplog.text
  assert os.listdir(tmp_path / 'local' / 'process_0') == []


def test_a_local_save_that_fails_is_logged_and_recorded_never_raised(
    tmp_path, monkeypatch, caplog):
  """A local tier failure of any kind (here: no host memory for the blocks) leaves training and the persistent tier going."""

  def no_memory(*args, **kwargs):
    del args, kwargs
    raise MemoryError('no host memory for the blocks')

  monkeypatch.setattr(layout, 'blocks_to_write', no_memory)
  failed = []

  def on_duration(event, duration, **kwargs):
    del duration
    if event == '/multihost/event/duration_secs':
      failed.append(kwargs.get('name'))

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  try:
    state, ckpt = _train(tmp_path, 7, save_every=5, local_every=3,
                         monkeypatch=monkeypatch)
  finally:
    jax.monitoring.unregister_event_duration_listener(on_duration)
  assert state.step == 7 and ckpt.steps() == [5, 7]
  assert failed.count('local save failed') == 2, failed  # steps 3 and 6
  assert ckpt.local.failed_saves == 2 and ckpt.local.saves == 0
  assert re.search(r'The local save of step 3 to .* failed \(MemoryError: '
                   r'no host memory for the blocks\)', caplog.text)
  assert _stored(tmp_path / 'local') == set()


def test_train_rejects_a_local_schedule_without_a_local_folder(tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith('JAX_')}
  proc = subprocess.run(
      [PY, TRAIN, f'--checkpoint_dir={tmp_path}', '--local_save_every=3'],
      env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
      check=False)
  # Bad flags: restarting will not help.
  assert proc.returncode == env_lib.NO_RETRY_EXIT_STATUS, (proc.stdout +
                                                          proc.stderr)
  assert '--local_save_every=3 needs --local_checkpoint_dir' in proc.stderr


# -- who shares a local folder: the folder says (issue 37) ---------------------


def test_processes_on_one_folder_read_one_identity_and_a_wiped_one_draws_anew(
    tmp_path):
  # Many first opens at once, on fresh folders: each must hand every opener
  # the one identity that is in place, never a half-written one.
  for trial in range(20):
    local = tmp_path / f'local{trial}'
    local.mkdir(mode=0o700)
    start = threading.Barrier(12)
    seen = []

    def open_folder(local=local, start=start, seen=seen):
      start.wait(30)
      seen.append(private.folder_id(str(local)))

    threads = [threading.Thread(target=open_folder) for _ in range(12)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(60)
    assert len(seen) == 12 and len(set(seen)) == 1, seen
    marker = local / private.FOLDER_ID_FILE
    assert marker.read_text() == seen[0] + '\n'
    assert stat.S_ISREG(marker.lstat().st_mode)
    assert stat.S_IMODE(marker.lstat().st_mode) == 0o600
    assert os.listdir(local) == [private.FOLDER_ID_FILE]  # no temporary file
  # It stays (a restart finds it); another folder, or this one wiped,
  # draws another.
  local = tmp_path / 'local0'
  first = private.folder_id(str(local))
  assert private.folder_id(str(local)) == first
  assert private.folder_id(str(tmp_path / 'local1')) != first
  shutil.rmtree(local)
  local.mkdir(mode=0o700)
  assert private.folder_id(str(local)) != first


def test_a_folder_identity_that_is_a_link_or_garbage_is_refused(tmp_path):
  local = tmp_path / 'local'
  local.mkdir(mode=0o700)
  elsewhere = tmp_path / 'elsewhere'
  elsewhere.write_text('0123456789abcdef\n')
  marker = local / private.FOLDER_ID_FILE
  marker.symlink_to(elsewhere)
  with pytest.raises(recovery.CheckpointFolderError,
                     match=r'\.recovery-local-disk is not a regular file .*'
                     r'never followed if a link.*Remove it'):
    private.folder_id(str(local))
  assert elsewhere.read_text() == '0123456789abcdef\n'
  marker.unlink()
  marker.write_text('not an identity\n')
  with pytest.raises(recovery.CheckpointFolderError,
                     match=r"holds 'not an identity', not 16 hex digits"):
    private.folder_id(str(local))


def test_the_local_host_is_the_folder_s_identity_unless_recovery_host_id_is_set(
    tmp_path, monkeypatch):
  # The local tier's host is the folder's identity ($RECOVERY_HOST_ID
  # unset), so a step's manifest names it.
  monkeypatch.delenv(recovery.HOST_ID_VARIABLE, raising=False)
  _train(tmp_path, 4, local_every=3, monkeypatch=monkeypatch)
  local = str(tmp_path / 'local')
  (stored,) = folder.scan(local)
  assert stored.manifest['host'] == f'folder-{private.folder_id(local)}'
  monkeypatch.setenv(recovery.HOST_ID_VARIABLE, 'rack1-node7')
  _train(tmp_path, 7, local_every=3, restart=True, monkeypatch=monkeypatch)
  newest = max(folder.scan(local), key=lambda s: s.step)
  assert newest.manifest['host'] == 'rack1-node7'


def test_a_block_a_restore_cannot_find_is_a_checkpoint_error_and_falls_back(
    tmp_path, monkeypatch, caplog):
  from recovery._src.local import tier as tier_lib  # pylint: disable=g-import-not-at-top
  _train(tmp_path, 11, save_every=4, local_every=3, monkeypatch=monkeypatch)
  _delete_persistent(tmp_path, 11)  # persistent step 8, local steps 6 and 9
  newest = tier_lib.LocalTier.newest

  def losing_a_block(self):
    # The hosts' lists name data/cursor of step 9; then its disk loses it
    # (as a process does whose host shares a name, not a folder, with the
    # one that wrote it).
    found = newest(self)
    step = _step_folder(tmp_path / 'local', 9)
    manifest = json.loads((step / 'manifest.json').read_text())
    manifest['entries'] = [e for e in manifest['entries']
                           if e['leaf'] != 'data/cursor']
    (step / 'manifest.json').write_text(json.dumps(manifest))
    return found

  monkeypatch.setattr(tier_lib.LocalTier, 'newest', losing_a_block)
  _, ckpt = _train(tmp_path, 12, save_every=4, restart=True,
                   monkeypatch=monkeypatch)
  assert (ckpt.resumed_from, ckpt.resumed_tier) == (8, 'persistent')
  # The host the step was saved on: the folder's identity.
  (host,) = {s.manifest['host'] for s in folder.scan(str(tmp_path / 'local'))}
  assert re.search(
      r'CheckpointError: Block data/cursor \[\] of local step 9 is missing on '
      rf'process 0 \(host {host} \(process 0 on [^)]+\), local folder '
      rf'{re.escape(str(tmp_path / "local"))}\): the hosts\' lists name it on '
      rf'{host} ', caplog.text), caplog.text
  assert 'falling back to the persistent tier' in caplog.text
  assert 'KeyError' not in caplog.text


def test_assembling_without_a_block_is_a_checkpoint_error_naming_it():
  from recovery._src.local import layout  # pylint: disable=g-import-not-at-top
  abstract = {'w': jax.ShapeDtypeStruct((8,), np.float32,
                                        sharding=_sharded()),
              'cursor': np.zeros((), np.int64)}
  with pytest.raises(recovery.CheckpointError,
                     match=r'block cursor \[\] is missing on process 0'):
    layout.assemble(abstract, {})
  with pytest.raises(recovery.CheckpointError,
                     match=r'^Local step 9: block cursor \[\] is missing'):
    layout.assemble(abstract, {}, where='Local step 9')
