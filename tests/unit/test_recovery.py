"""Single-controller tests of `recovery`: sampler, state, checkpoints, replay.

These run in the pytest process on whatever CPU devices it has (one or more);
multi-controller behaviour is in test_recovery_multiprocess.py and
test_train.py.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import _helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multihost import env as env_lib
import recovery
from recovery._src.run import pending

ROOT = pathlib.Path(__file__).resolve().parents[2]
WIDTH = 4
SAMPLES = 12
BATCH = 4  # 3 steps per epoch.


def _mesh():
  return jax.make_mesh((jax.device_count(),), ('data',))


def _rep():
  return jax.sharding.NamedSharding(_mesh(), jax.sharding.PartitionSpec())


def _toy_loop(*, check_fn=None) -> recovery.ResilientLoop:
  """A tiny least-squares model with momentum, replicated on every device."""
  rng = np.random.default_rng(0)
  data = rng.normal(size=(SAMPLES, WIDTH)).astype(np.float32)
  targets = data @ np.linspace(-1, 1, WIDTH, dtype=np.float32)
  rep = _rep()

  @jax.jit
  def step_fn(user, batch):
    x, y = batch
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y)**2))(
        user['w'])
    v = 0.8 * user['v'] + g
    return {'w': user['w'] - 0.05 * v, 'v': v}, loss

  def data_fn(ids):
    return (jax.device_put(data[ids], rep), jax.device_put(targets[ids], rep))

  return recovery.ResilientLoop(
      step_fn, data_fn=data_fn, sampler=recovery.EpochSampler(SAMPLES, BATCH),
      check_fn=check_fn)


def _initial(loop, seed=3) -> recovery.TransitionState:
  zeros = np.zeros(WIDTH, np.float32)
  user = {'w': jax.device_put(zeros, _rep()),
          'v': jax.device_put(zeros, _rep())}
  return loop.init(user, jax.random.key(seed))


def _run(loop, state, steps):
  records = []
  for _ in range(steps):
    state, rec = loop.step(state)
    records.append(rec)
  return state, records


# -- sampler and state --------------------------------------------------------


def test_sampler_reshuffles_from_the_carried_key_at_epoch_boundaries():
  loop = _toy_loop()
  state, records = _run(loop, _initial(loop), 7)
  epochs = [r.epoch for r in records]
  assert epochs == [0, 0, 0, 1, 1, 1, 2]
  first = np.concatenate([r.ids for r in records[:3]])
  second = np.concatenate([r.ids for r in records[3:6]])
  # Each epoch is a permutation of all samples, and a different one.
  assert sorted(first.tolist()) == list(range(SAMPLES))
  assert sorted(second.tolist()) == list(range(SAMPLES))
  assert first.tolist() != second.tolist()
  # The same key gives the same ids; another key another order.
  _, again = _run(loop, _initial(loop), 7)
  assert [r.ids.tolist() for r in again] == [r.ids.tolist() for r in records]
  _, other = _run(loop, _initial(loop, seed=4), 3)
  assert ([r.ids.tolist() for r in other]
          != [r.ids.tolist() for r in records[:3]])
  assert (state.step, state.epoch, state.cursor) == (7, 2, BATCH)


def test_sampler_rejects_bad_sizes():
  with pytest.raises(ValueError, match='batch_size=5, num_samples=4'):
    recovery.EpochSampler(4, 5)


def test_transition_state_round_trips_through_its_tree_with_typed_key():
  loop = _toy_loop()
  state, _ = _run(loop, _initial(loop), 4)
  tree = state.to_tree()
  assert tree['data']['key'].dtype == np.uint32
  back = recovery.TransitionState.from_tree(tree, key_like=state.key)
  assert jax.dtypes.issubdtype(back.key.dtype, jax.dtypes.prng_key)
  assert recovery.checkpoint_digest(back) == recovery.checkpoint_digest(state)
  # The restored key draws the same next batches.
  _, a = _run(loop, state, 3)
  _, b = _run(loop, back, 3)
  assert [r.ids.tolist() for r in a] == [r.ids.tolist() for r in b]


def test_init_rejects_raw_uint32_keys():
  loop = _toy_loop()
  with pytest.raises(TypeError, match='typed PRNG key'):
    loop.init({}, jax.random.PRNGKey(0))


def test_digest_is_the_same_on_any_placement_and_changes_with_content():
  value = np.arange(8, dtype=np.float32)
  mesh = _mesh()
  sharded = value
  if 8 % jax.device_count() == 0:
    sharded = jax.device_put(value, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec('data')))
  single = jax.device_put(value, jax.devices()[0])
  digests = {recovery.checkpoint_digest({'x': v})
             for v in (value, single, sharded, jax.device_put(value, _rep()))}
  assert len(digests) == 1
  assert recovery.checkpoint_digest({'x': value + 1}) not in digests
  assert recovery.checkpoint_digest({'y': value}) not in digests  # Paths count.
  # The same bytes under another dtype.
  assert recovery.checkpoint_digest({'x': value.view(np.int32)}) not in digests


def test_step_check_failure_names_the_step():
  def check(old, new, ids, loss):
    del old, new, loss
    np.testing.assert_array_less(ids, 0, err_msg='ids must be negative')
  loop = _toy_loop(check_fn=check)
  with pytest.raises(recovery.StepCheckError,
                     match=r'Step 1 \(sample ids .*\) failed its independent '
                     r'check(.|\n)*ids must be'):
    loop.step(_initial(loop))


def test_the_loop_reads_no_loss_unless_asked_and_its_records_read_it_on_use():
  loop = _toy_loop()
  records = []
  result = loop.run(_initial(loop), until_step=5,
                    on_step=lambda s, rec: records.append(rec))
  # Only the result read a loss (the last step's); the others stayed on the
  # device until asked for here.
  assert ['loss' in vars(r) for r in records] == [False] * 4 + [True]
  _, straight = _run(loop, _initial(loop), 5)
  assert [r.loss for r in records] == [r.loss for r in straight]
  assert result.last_loss == straight[-1].loss
  assert all(isinstance(r.loss, float) for r in records)


def _dispatch_ahead(first_rounds: int) -> tuple[list[int], bool]:
  """A 14-step run whose first step is `first_rounds` matrix products.

  Returns how many dispatched steps were unfinished at each load, and
  whether the first step was still unfinished at every load up to the one
  where the queue is full.
  """
  # The first step is long device work, the others short; each reads the
  # state the one before wrote, so none finishes before the first. One
  # device, so that the work is not repeated on each.
  rep = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  a = jax.device_put(np.eye(512, dtype=np.float32) * 0.5, rep)
  step_fn = _dispatch_ahead_step
  records, unfinished_at_load, first_busy = [], [], []
  most = pending.KEEP + pending.EVERY - 1

  def data_fn(ids):
    del ids
    # How many of the steps dispatched so far were unfinished at this load.
    unfinished_at_load.append(
        sum(not r.raw_loss.is_ready() for r in records))
    if records and len(unfinished_at_load) <= most + 1:
      first_busy.append(not records[0].raw_loss.is_ready())
    # The batch is the number of rounds: long for the first step only.
    rounds = first_rounds if len(unfinished_at_load) == 1 else 2
    return jax.device_put(np.int32(rounds), rep)

  loop = recovery.ResilientLoop(step_fn, data_fn=data_fn,
                                sampler=recovery.EpochSampler(24, 2))
  state = loop.init({'m': a, 'a': a}, jax.random.key(0))
  loop.run(state, until_step=14, on_step=lambda s, rec: records.append(rec))
  return unfinished_at_load, all(first_busy)


@jax.jit
def _dispatch_ahead_step(user, batch):
  m = jax.lax.fori_loop(0, batch, lambda i, m: jnp.tanh(m @ user['a']),
                        user['m'])
  return {'m': m, 'a': user['a']}, jnp.sum(m)


def test_the_loop_dispatches_ahead_of_the_device_by_a_bounded_number_of_steps():
  # An order, not a timing: the run counts only where the first step's
  # device work outlasted the host's loads up to a full queue; where the
  # machine's load let it finish sooner, the run is repeated with four
  # times the work (a loop that waits for each step fails all three).
  most, keep = pending.KEEP + pending.EVERY - 1, pending.KEEP
  tries = []
  for rounds in (600, 2400, 9600):
    unfinished_at_load, first_stayed_busy = _dispatch_ahead(rounds)
    tries.append(unfinished_at_load)
    if first_stayed_busy:
      break
  else:
    raise AssertionError(
        f'the first step never stayed unfinished while the host loaded '
        f'{most + 1} batches: the loop does not run ahead; loads: {tries}')
  # The host ran ahead until `most` steps were queued, then waited until
  # `keep` were, and never let more than `most` queue.
  assert unfinished_at_load[:most + 1] == list(range(most + 1)), (
      unfinished_at_load)
  assert max(unfinished_at_load) == most, unfinished_at_load
  assert unfinished_at_load[most + 1] <= keep, unfinished_at_load


@pytest.mark.parametrize('overlap', [False, True])
def test_an_overlapped_check_runs_after_the_next_dispatch_and_before_a_save(
    tmp_path, overlap):
  events = []

  def check(old, new, ids, loss):
    del old, new, ids, loss
    events.append('check')
    if events.count('check') == 2:
      raise AssertionError('step 2 is bad')

  loop = _toy_loop(check_fn=check)
  loop.overlap_check = overlap
  load = loop.data_fn
  loop.data_fn = lambda ids: (events.append('load'), load(ids))[1]
  with recovery.Checkpoints(tmp_path / 'c', save_every=2,
                            async_save=False) as ckpt:
    with pytest.raises(recovery.StepCheckError,
                       match=r'Step 2 \(sample ids .*step 2 is bad'):
      loop.run(_initial(loop), until_step=6, checkpoints=ckpt)
    assert ckpt.latest_step() is None  # Step 2 failed: never saved.
  # Step 1's check before step 2's batch, or (overlapped) after it; step 2
  # saves (it settles), so its check runs at once either way.
  assert events == (['load', 'load', 'check', 'check'] if overlap else
                    ['load', 'check', 'load', 'check']), events
  # Step 4's check, overlapped, runs before the run saves it and returns.
  events.clear()
  ok = _toy_loop(check_fn=lambda *a: events.append('check'))
  ok.overlap_check = overlap
  with recovery.Checkpoints(tmp_path / 'd', save_every=4,
                            async_save=False) as ckpt:
    ok.run(_initial(ok), until_step=5,
           on_step=lambda s, rec: events.append(f'step {rec.step}'),
           checkpoints=ckpt)
    assert ckpt.steps() == [4, 5]
  assert events.count('check') == 5

  def checks_before(event):
    return events[:events.index(event)].count('check')
  assert checks_before('step 4') == 4, events
  assert checks_before('step 3') == (2 if overlap else 3), events


# -- checkpoints --------------------------------------------------------------


def _entries(directory) -> list[str]:
  """The checkpoint folder's entries, sorted, without its hidden files (the lock)."""
  return sorted(n for n in os.listdir(directory) if not n.startswith('.'))


def _saved_run(tmp_path, steps=7, save_every=3, keep=2):
  loop = _toy_loop()
  directory = tmp_path / 'ckpt'
  with recovery.Checkpoints(directory, save_every=save_every,
                            keep=keep) as ckpt:
    result = loop.run(_initial(loop), until_step=steps, checkpoints=ckpt)
    assert ckpt.steps() == [6, 7]
  return loop, directory, result.state


def test_checkpoint_round_trip_onto_the_targets_shardings(tmp_path):
  loop, directory, final = _saved_run(tmp_path)
  with recovery.Checkpoints(directory) as ckpt:
    restored = ckpt.start(_initial(loop), resume=True)
    assert restored.step == 7
    assert recovery.checkpoint_digest(restored) == recovery.checkpoint_digest(final)
    assert restored.user['w'].sharding == _rep()
    older = ckpt.restore(_initial(loop), step=6)
    assert older.step == 6
    meta = ckpt.read_meta(7)
    assert meta['digest'] == recovery.checkpoint_digest(final)
    assert meta['reason'] == 'final'


def test_start_is_strict_about_resume(tmp_path):
  loop, directory, _ = _saved_run(tmp_path)
  with recovery.Checkpoints(directory) as ckpt:
    with pytest.raises(recovery.FolderNotFreshError,
                       match=r'already holds checkpoint steps \[6, 7\]\. '
                       r'Start with resume=True'):
      ckpt.start(_initial(loop), resume=False)
    with pytest.raises(recovery.FolderNotFreshError):
      ckpt.start(_initial(loop))  # The default, without a restart.
  with recovery.Checkpoints(tmp_path / 'fresh') as ckpt:
    with pytest.raises(recovery.NothingToResumeError,
                       match="No committed checkpoint.*Start with "
                       "resume=False.*resume='if_present'"):
      ckpt.start(_initial(loop), resume=True)
    with pytest.raises(ValueError, match="resume must be True, False, "
                       "'if_present' or None.*got 'yes'"):
      ckpt.start(_initial(loop), resume='yes')


def _without_restart(monkeypatch):
  for name in recovery.RESTART_COUNT_VARIABLES:
    monkeypatch.delenv(name, raising=False)


def test_resume_if_present_starts_fresh_then_resumes(tmp_path, monkeypatch,
                                                     caplog):
  _without_restart(monkeypatch)
  loop = _toy_loop()
  folder = tmp_path / 'ckpt'
  with recovery.Checkpoints(folder, save_every=3) as ckpt:
    state = ckpt.start(_initial(loop), resume='if_present')
    assert state.step == 0 and ckpt.resumed_from is None
    first = loop.run(state, until_step=4, checkpoints=ckpt)
  with caplog.at_level('INFO'):
    with recovery.Checkpoints(folder, save_every=3) as ckpt:
      state = ckpt.start(_initial(loop), resume='if_present')
      assert ckpt.resumed_from == 4
  assert 'Resuming from checkpoint step 4' in caplog.text
  assert (recovery.checkpoint_digest(state)
          == recovery.checkpoint_digest(first.state))


@pytest.mark.parametrize('variable', ['SLURM_RESTART_COUNT',
                                      'MULTIHOST_RESTART_COUNT'])
def test_a_restart_resumes_if_present_by_default(tmp_path, monkeypatch,
                                                 variable):
  _without_restart(monkeypatch)
  loop, directory, final = _saved_run(tmp_path)
  monkeypatch.setenv(variable, '1')
  with recovery.Checkpoints(tmp_path / 'empty') as ckpt:
    assert ckpt.start(_initial(loop)).step == 0  # Nothing yet: fresh.
  with recovery.Checkpoints(directory) as ckpt:
    state = ckpt.start(_initial(loop))
    assert ckpt.resumed_from == 7
    assert (recovery.checkpoint_digest(state)
            == recovery.checkpoint_digest(final))
    # The strict modes stay strict on a restart.
    with pytest.raises(recovery.FolderNotFreshError):
      ckpt.start(_initial(loop), resume=False)
  with recovery.Checkpoints(tmp_path / 'empty2') as ckpt:
    with pytest.raises(recovery.NothingToResumeError):
      ckpt.start(_initial(loop), resume=True)
  monkeypatch.setenv(variable, '0')  # A first run: the strict default.
  with recovery.Checkpoints(directory) as ckpt:
    with pytest.raises(recovery.FolderNotFreshError):
      ckpt.start(_initial(loop))


def test_wrong_shapes_give_a_clear_error(tmp_path):
  _, directory, _ = _saved_run(tmp_path)
  zeros = np.zeros(WIDTH + 2, np.float32)
  loop = _toy_loop()
  target = loop.init({'w': jax.device_put(zeros, _rep()),
                      'v': jax.device_put(zeros, _rep())}, jax.random.key(3))
  with recovery.Checkpoints(directory) as ckpt:
    with pytest.raises(recovery.CheckpointError,
                       match=r'does not fit this run: user/v: checkpoint has '
                       r'\[\[4\], .float32.\], this run expects '
                       r'\[\[6\].*different model or data configuration'
                       ) as raised:
      ckpt.restore(target)
  assert isinstance(raised.value, recovery.CheckpointMismatchError)
  assert '--' not in str(raised.value)  # recovery names no binary's flags


def test_altered_checkpoint_fails_its_digest_check(tmp_path):
  """A value changed behind Orbax's back reads cleanly; the digest sees it."""
  loop, directory, _ = _saved_run(tmp_path)
  # Another run's step-7 state item (same structure, other values) replaces
  # this run's, keeping this run's metadata (and so its digest).
  other = tmp_path / 'other'
  with recovery.Checkpoints(other) as ckpt:
    loop.run(_initial(loop, seed=99), until_step=7, checkpoints=ckpt)
  shutil.rmtree(directory / '7' / 'state')
  shutil.copytree(other / '7' / 'state', directory / '7' / 'state')
  with recovery.Checkpoints(directory) as ckpt:
    with pytest.raises(recovery.CheckpointCorruptError,
                       match=r'step 7 .* fails its digest check.*changed: '
                       r'data/key, data/order, user/v, user/w\).*previous '
                       r'checkpoint \(step 6\)'):
      ckpt.start(_initial(loop), resume=True)
    assert ckpt.restore(_initial(loop), step=6).step == 6  # Untouched.
  # bin/verify_checkpoint.py reports the same mismatch and exits 1.
  done = subprocess.run(
      [sys.executable, str(pathlib.Path(__file__).parents[2] / 'bin' /
                           'verify_checkpoint.py'),
       f'--checkpoint_dir={directory}'],
      capture_output=True, text=True, timeout=300,
      env={**os.environ, env_lib.PLATFORMS: 'cpu'})
  assert done.returncode == 1, done.stdout + done.stderr
  assert re.search(r'step 7: FAIL CheckpointCorruptError: .*fails its digest '
                   r'check.*changed: data/key, data/order, user/v, user/w',
                   done.stdout), done.stdout + done.stderr
  assert re.search(r'step 6: OK', done.stdout), done.stdout
  assert 'FAIL: 1 of 2 checkpoints are bad.' in done.stdout, done.stdout


def test_damaged_array_bytes_give_a_clear_error(tmp_path):
  loop, directory, _ = _saved_run(tmp_path)
  pattern = str(directory / '7' / 'state' / '**' / 'd' / '*')
  files = [f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)]
  assert files
  for f in files:
    size = os.path.getsize(f)
    with open(f, 'r+b') as fh:
      fh.write(np.random.default_rng(1).bytes(size))
  # Bytes damaged this badly fail TensorStore's own decoding before any
  # digest is computed: a plain CheckpointError saying the files cannot be
  # read, naming the step to fall back to (docs/recovery.md, "Damaged checkpoints"). Altered
  # bytes that still decode give CheckpointCorruptError (test above).
  with recovery.Checkpoints(directory) as ckpt:
    with pytest.raises(recovery.CheckpointError,
                       match=r'Checkpoint step 7 .*cannot be read.*damaged '
                       r'or incomplete.*step 6') as raised:
      ckpt.restore(_initial(loop))
  assert type(raised.value) is recovery.CheckpointDamagedError, raised.value


def _damage(directory, step, how, tmp_path, loop):
  """Damages committed `step`: its array bytes flipped, or a value rewritten."""
  if how == 'bytes':  # TensorStore cannot decode them (DATA_LOSS).
    files = [f for f in (directory / str(step) / 'state').rglob('*')
             if f.is_file() and f.parent.name == 'd']
    assert files
    for f in files:
      f.write_bytes(np.random.default_rng(1).bytes(f.stat().st_size))
  else:  # Another run's state item: it reads, and fails its digest check.
    other = tmp_path / f'other-{step}'
    with recovery.Checkpoints(other, save_every=step) as ckpt:
      loop.run(_initial(loop, seed=99), until_step=step, checkpoints=ckpt)
    shutil.rmtree(directory / str(step) / 'state')
    shutil.copytree(other / str(step) / 'state',
                    directory / str(step) / 'state')


def _set_aside_lines(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if 'Set it aside as' in
          r.getMessage()]


@pytest.mark.parametrize('how', ['bytes', 'value'])
@pytest.mark.parametrize('mode', ['if_present', 'restart'])
def test_a_damaged_newest_step_is_set_aside_and_the_run_falls_back(
    tmp_path, monkeypatch, caplog, how, mode):
  """resume='if_present', or a restart: the previous step resumes, nothing is lost."""
  _without_restart(monkeypatch)
  loop, directory, _ = _saved_run(tmp_path)  # steps 6 and 7
  straight, _ = _run(loop, _initial(loop), 10)
  _damage(directory, 7, how, tmp_path, loop)
  resume = 'if_present'
  if mode == 'restart':  # The default mode, on a restart.
    monkeypatch.setenv('MULTIHOST_RESTART_COUNT', '1')
    resume = None
  caplog.set_level('INFO')
  events = []

  def on_event(event, seconds, **meta):
    del seconds
    events.append((event, meta.get('name')))

  with recovery.Checkpoints(directory, save_every=3, keep=2) as ckpt:
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
      state = ckpt.start(_initial(loop), resume=resume)
    finally:
      jax.monitoring.unregister_event_duration_listener(on_event)
    assert events.count(('/multihost/event/duration_secs',
                         'checkpoint set aside')) == 1, events
    assert (ckpt.resumed_from, ckpt.resumed_tier, state.step) == (
        6, 'persistent', 6)
    (aside,) = ckpt.set_aside
    assert (aside.step, aside.tier) == (7, 'persistent')
    moved = aside.path
    assert re.fullmatch(r'7\.damaged-\d{8}T\d{6}Z', os.path.basename(moved))
    assert os.path.dirname(moved) == str(directory)
    assert ckpt.steps() == [6]
    result = loop.run(state, until_step=10, checkpoints=ckpt)
    # Steps 9 and 10 were due (7 was not); keep-N kept the newest 2.
    assert ckpt.steps() == [9, 10]
  assert (recovery.checkpoint_digest(result.state)
          == recovery.checkpoint_digest(straight))
  # The damaged step is kept, whole, beside the others; never deleted.
  assert _entries(directory) == (
      sorted(['9', '10', os.path.basename(moved)]))
  assert (pathlib.Path(moved) / 'state').is_dir()
  why = ('its files cannot be read' if how == 'bytes'
         else 'it fails its digest check')
  (line,) = _set_aside_lines(caplog)
  assert re.search(
      rf'Checkpoint step 7 in {re.escape(str(directory))} is damaged: {why}'
      rf'.*Set it aside as {re.escape(moved)} \(kept, never read or deleted\);'
      r' resuming from persistent step 6 instead\.', line), line
  # A later start sees steps 9 and 10 only.
  with recovery.Checkpoints(directory, save_every=3, keep=2) as ckpt:
    assert ckpt.start(_initial(loop), resume=True).step == 10
    assert ckpt.set_aside == []


def test_a_strict_resume_refuses_a_damaged_step_and_says_how_to_fall_back(
    tmp_path, monkeypatch):
  _without_restart(monkeypatch)
  loop, directory, _ = _saved_run(tmp_path)
  _damage(directory, 7, 'bytes', tmp_path, loop)
  with recovery.Checkpoints(directory) as ckpt:
    with pytest.raises(recovery.CheckpointDamagedError,
                       match=r"step 7 .*cannot be read.*Start with "
                       r"resume='if_present' \(the default on a restart\) "
                       r'to set it aside \(renamed 7\.damaged-<UTC time> in '
                       r'.*, kept\) and resume from the previous checkpoint '
                       r'\(step 6\)'):
      ckpt.start(_initial(loop), resume=True)
    assert ckpt.set_aside == []
  assert _entries(directory) == [
      '6', '7']
  # On a restart, the same resume=True falls back: no one is there.
  monkeypatch.setenv('SLURM_RESTART_COUNT', '2')
  with recovery.Checkpoints(directory) as ckpt:
    assert ckpt.start(_initial(loop), resume=True).step == 6
    assert [(a.step, a.tier) for a in ckpt.set_aside] == [(7, 'persistent')]


def test_when_no_step_verifies_nothing_is_set_aside(tmp_path, monkeypatch):
  _without_restart(monkeypatch)
  loop, directory, _ = _saved_run(tmp_path)
  _damage(directory, 7, 'value', tmp_path, loop)
  _damage(directory, 6, 'bytes', tmp_path, loop)
  with recovery.Checkpoints(directory) as ckpt:
    with pytest.raises(recovery.CheckpointDamagedError,
                       match=r'step 6 .*cannot be read.*No older checkpoint '
                       r'exists here; start fresh in a new folder\. The newer '
                       r'steps are damaged too \(step 7: it fails its digest '
                       r'check.*\): no checkpoint in .* verifies, so none was '
                       r'set aside\.'):
      ckpt.start(_initial(loop), resume='if_present')
    assert ckpt.set_aside == []
  assert _entries(directory) == [
      '6', '7']


def _train(*args, log) -> tuple[int, str]:
  """bin/train.py as one single-controller subprocess; (exit status, output)."""
  env = {k: v for k, v in os.environ.items()
         if k not in recovery.RESTART_COUNT_VARIABLES
         and not k.startswith(('MULTIHOST_', 'SLURM_', 'OMPI_', 'JAX_'))}
  env.update({env_lib.PLATFORMS: 'cpu', **_helpers.quick_compile_env()})
  with open(log, 'wb') as out:
    done = subprocess.run(
        [sys.executable, str(ROOT / 'bin' / 'train.py'), *args], env=env,
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
        stderr=subprocess.STDOUT, timeout=300, check=False)
  return done.returncode, log.read_text()


def test_train_sets_a_damaged_step_aside_with_resume_if_present(tmp_path):
  """--resume_if_present ends equal to the uninterrupted run (--resume's refusal: test_train.py's test_corrupt_checkpoint_is_a_clear_error_and_loses_nothing)."""
  ref, ckpt = tmp_path / 'ref', tmp_path / 'ckpt'
  rc, out = _train(f'--checkpoint_dir={ref}', '--steps=20', '--save_every=5',
                   '--keep=4', log=tmp_path / 'ref.log')
  assert rc == 0, out[-3000:]
  (digest,) = re.findall(r'Finished step 20 .*digest (\w+)', out)
  # Steps 5 and 10 of that run, as a run stopped after step 10 left them.
  shutil.copytree(ref, ckpt, ignore=shutil.ignore_patterns('15', '20'))
  for f in (ckpt / '10' / 'state').rglob('*'):
    if f.is_file() and f.parent.name == 'd':
      f.write_bytes(np.random.default_rng(0).bytes(f.stat().st_size))
  args = [f'--checkpoint_dir={ckpt}', '--steps=20', '--save_every=5',
          '--keep=4']
  metrics = tmp_path / 'metrics.jsonl'
  rc, out = _train(*args, '--resume_if_present', f'--metrics_out={metrics}',
                   log=tmp_path / 'fallback.log')
  assert rc == 0, out[-3000:]
  assert 'Resumed from step 5 (epoch' in out, out[-3000:]
  assert re.findall(r'Finished step 20 .*digest (\w+)', out) == [digest]
  lines = [ln for ln in out.splitlines() if 'is damaged' in ln]
  assert len(lines) == 1, lines
  (moved,) = [n for n in os.listdir(ckpt) if n.startswith('10.damaged-')]
  assert re.search(rf'Checkpoint step 10 in {re.escape(str(ckpt))} is '
                   r'damaged: its files cannot be read \(.*DATA_LOSS.*\)\. '
                   rf'Set it aside as {re.escape(str(ckpt / moved))} '
                   r'\(kept, never read or deleted\); resuming from persistent '
                   r'step 5 instead\.', lines[0]), lines[0]
  events = [json.loads(ln) for ln in metrics.read_text().splitlines()
            if '"event"' in ln]
  assert {'event': 'set_aside', 'step': 10, 'tier': 'persistent',
          'moved_to': str(ckpt / moved), 'resumed_from': 5} in events, events
  assert sorted(n for n in os.listdir(ckpt) if n.isdigit()) == [
      '10', '15', '20', '5']


def test_train_records_a_step_damaged_in_both_tiers_once_per_tier(tmp_path):
  """Local and persistent step 10 both damaged: --metrics_out has a set_aside record for each, with its tier; local step 5 resumes."""
  ckpt, local = tmp_path / 'ckpt', tmp_path / 'local'
  args = [f'--checkpoint_dir={ckpt}', f'--local_checkpoint_dir={local}',
          '--steps=10', '--save_every=5', '--local_save_every=5']
  rc, out = _train(*args, log=tmp_path / 'first.log')
  assert rc == 0, out[-3000:]
  (digest,) = re.findall(r'Finished step 10 .*digest (\w+)', out)
  (data,) = (local / 'process_0').glob('10-*/data.bin')
  raw = bytearray(data.read_bytes())
  raw[-1] ^= 0xff  # It fails its digest check.
  data.write_bytes(bytes(raw))
  for f in (ckpt / '10' / 'state').rglob('*'):  # Its files cannot be read.
    if f.is_file() and f.parent.name == 'd':
      f.write_bytes(np.random.default_rng(0).bytes(f.stat().st_size))
  metrics = tmp_path / 'metrics.jsonl'
  rc, out = _train(*args, '--resume_if_present', f'--metrics_out={metrics}',
                   log=tmp_path / 'again.log')
  assert rc == 0, out[-3000:]
  assert 'Resumed from step 5 (epoch 0) from the local tier' in out, (
      out[-3000:])
  assert re.findall(r'Finished step 10 .*digest (\w+)', out) == [digest]
  records = [json.loads(ln) for ln in metrics.read_text().splitlines()
             if '"set_aside"' in ln]
  beside = {'local': local / 'process_0', 'persistent': ckpt}
  moved = sorted(str(p) for d in beside.values() for p in d.iterdir()
                 if '.damaged-' in p.name)
  assert len(moved) == 2, moved
  assert sorted(r['moved_to'] for r in records) == moved, records
  assert [(r['step'], r['tier'], r['resumed_from']) for r in records] == [
      (10, 'local', 5), (10, 'persistent', 5)], records
  for r in records:
    assert os.path.dirname(r['moved_to']) == str(beside[r['tier']]), r


# Orbax leaves an asyncio callback behind when the JSON item fails to parse.
@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
def test_corrupt_metadata_gives_a_clear_error(tmp_path):
  loop, directory, _ = _saved_run(tmp_path)
  (directory / '7' / 'meta' / 'metadata').write_text('{not json')
  with recovery.Checkpoints(directory) as ckpt:
    with pytest.raises(recovery.CheckpointError,
                       match=r'step 7 .*`meta` item cannot be read.*step 6'):
      ckpt.restore(_initial(loop))


def test_partial_save_is_ignored_and_reported(tmp_path):
  loop, directory, _ = _saved_run(tmp_path)
  shutil.copytree(directory / '7', directory / '9.orbax-checkpoint-tmp')
  shutil.rmtree(directory / '9.orbax-checkpoint-tmp' / 'state')
  with recovery.Checkpoints(directory) as ckpt:
    assert ckpt.partial_steps == [9]
    assert ckpt.latest_step() == 7
    assert ckpt.start(_initial(loop), resume=True).step == 7


def test_unwritable_folder_is_a_clear_error(tmp_path):
  blocker = tmp_path / 'a-file'
  blocker.write_text('x')
  with pytest.raises(recovery.CheckpointError, match='is not writable'):
    recovery.Checkpoints(blocker / 'ckpt')


def test_run_resumed_from_a_checkpoint_matches_the_uninterrupted_run(tmp_path):
  loop = _toy_loop()
  straight, _ = _run(loop, _initial(loop), 10)
  with recovery.Checkpoints(tmp_path / 'a', save_every=4) as ckpt:
    loop.run(_initial(loop), until_step=5, checkpoints=ckpt)
  with recovery.Checkpoints(tmp_path / 'a', save_every=4) as ckpt:
    resumed = ckpt.start(_initial(loop), resume=True)
    assert resumed.step == 5
    result = loop.run(resumed, until_step=10, checkpoints=ckpt)
    assert ckpt.steps() == [8, 10] or ckpt.steps()[-1] == 10
  assert recovery.checkpoint_digest(result.state) == recovery.checkpoint_digest(straight)


# -- replay -------------------------------------------------------------------


def test_verify_replay_across_an_epoch_boundary(tmp_path):
  loop = _toy_loop()
  with recovery.Checkpoints(tmp_path / 'r', save_every=2) as ckpt:
    result = loop.run(_initial(loop), until_step=2, checkpoints=ckpt)
    restored = ckpt.restore(_initial(loop), step=2)
  replay = recovery.verify_replay(loop, result.state, restored, 3)
  assert [r.step for r in replay] == [3, 4, 5]
  # Step 4 starts epoch 1: the replay drew a reshuffled order there too.
  _, straight = _run(loop, _initial(loop), 5)
  assert [r.ids.tolist() for r in replay] == [
      r.ids.tolist() for r in straight[2:]]
  assert [r.epoch for r in straight[2:]] == [0, 1, 1]
  assert all(r.reference_loss == r.replayed_loss for r in replay)


def test_verify_replay_detects_a_diverging_state(tmp_path):
  loop = _toy_loop()
  state, _ = _run(loop, _initial(loop), 2)
  bad = state.replace(user={'w': state.user['w'] + 1e-3, 'v': state.user['v']})
  with pytest.raises(recovery.ReplayMismatchError, match='user/w'):
    recovery.verify_replay(loop, state, bad, 2)
  shifted = state.replace(cursor=0)
  with pytest.raises(recovery.ReplayMismatchError, match='data/cursor'):
    recovery.verify_replay(loop, state, shifted, 2)


# -- preemption on a single controller ----------------------------------------


def test_single_controller_sigterm_saves_and_stops(tmp_path):
  loop = _toy_loop()
  before = signal.getsignal(signal.SIGTERM)

  def on_step(state, record):
    del record
    if state.step == 4:
      os.kill(os.getpid(), signal.SIGTERM)

  with recovery.Checkpoints(tmp_path / 'p', save_every=100) as ckpt:
    result = loop.run(_initial(loop), until_step=50, checkpoints=ckpt,
                      on_step=on_step)
    assert result.preempted
    assert result.state.step == 4
    assert ckpt.steps() == [4]
    assert json.loads(json.dumps(ckpt.read_meta(4)))['reason'] == 'preemption'
  assert signal.getsignal(signal.SIGTERM) == before
