"""Checkpoint folders under faults: two trainers, foreign folders, crashed saves."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import select
import shutil
import socket
import subprocess
import sys

import pytest
import test_recovery as tr

import recovery

HOLDER = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'folder_holder.py')


def _holder(directory):
  """Another run, in its own process, that holds `directory`."""
  proc = subprocess.Popen([sys.executable, HOLDER, str(directory)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True)
  try:
    proc.stdin.write('go 0\n')
    proc.stdin.flush()
    assert select.select([proc.stdout], [], [], 120)[0], 'no answer in 120 s'
    assert proc.stdout.readline().strip() == 'won'
  except BaseException:
    proc.kill()
    proc.wait(10)
    raise
  return proc


def _listing(directory):
  return sorted(os.path.relpath(os.path.join(d, f), directory)
                for d, _, files in os.walk(directory) for f in files
                if not f.startswith('.recovery-lock'))


def test_a_second_run_is_refused_naming_the_holder_and_loses_nothing(tmp_path):
  loop, directory, final = tr._saved_run(tmp_path)
  before = _listing(directory)
  holder = _holder(directory)
  try:
    with pytest.raises(recovery.CheckpointError,
                       match=rf'in use by another run .*pid {holder.pid}'):
      recovery.Checkpoints(directory, save_every=1, keep=1)
    assert _listing(directory) == before
    # A run that died leaves a stale lock: the next run takes it over.
    holder.kill()
    holder.wait(10)
  finally:
    if holder.poll() is None:
      holder.kill()
      holder.wait(10)
  with recovery.Checkpoints(directory) as ckpt:
    restored = ckpt.start(tr._initial(loop), resume=True)
    assert recovery.checkpoint_digest(restored) == recovery.checkpoint_digest(final)
  assert not (directory / '.recovery-lock').exists()


def test_a_foreign_folder_is_untouched_and_named(tmp_path, caplog):
  loop, directory, _ = tr._saved_run(tmp_path)
  (directory / '1').mkdir()
  (directory / '1' / 'notes.txt').write_text('mine, not a checkpoint')
  with caplog.at_level(logging.WARNING):
    with recovery.Checkpoints(directory, save_every=3, keep=2) as ckpt:
      state = ckpt.start(tr._initial(loop), resume=True)
      loop.run(state, until_step=13, checkpoints=ckpt)
      assert ckpt.steps() == [12, 13]
  assert (directory / '1' / 'notes.txt').read_text() == 'mine, not a checkpoint'
  assert "holds ['1'], which is not checkpoints of this project" in caplog.text


def test_leftovers_of_a_crashed_save_are_removed_at_start(tmp_path, caplog):
  loop, directory, _ = tr._saved_run(tmp_path)
  (directory / '9.orbax-checkpoint-tmp-123').mkdir()
  (directory / '9.orbax-checkpoint-tmp-123' / 'junk').write_text('x')
  with caplog.at_level(logging.WARNING):
    with recovery.Checkpoints(directory) as ckpt:
      assert ckpt.latest_step() == 7
  assert not (directory / '9.orbax-checkpoint-tmp-123').exists()
  assert 'Removing 9.orbax-checkpoint-tmp-123' in caplog.text


def _snapshot(folder) -> dict[str, str]:
  """Every file under `folder` (links not followed) -> a digest of its bytes."""
  out = {}
  for d, _, files in os.walk(folder):
    for f in files:
      path = os.path.join(d, f)
      with open(path, 'rb') as fh:
        out[os.path.relpath(path, folder)] = hashlib.sha256(
            fh.read()).hexdigest()
  return out


def _parallel_deletes(monkeypatch):
  # Orbax deletes a step with os.cpu_count() // 2 threads (a scan that
  # follows a symlinked root); on a 2-CPU host it would use plain rmtree,
  # which refuses a link. Report 8 CPUs, as on the hosts where the attack
  # emptied the other experiment.
  monkeypatch.setattr(os, 'cpu_count', lambda: 8)


def test_keep_never_deletes_or_writes_through_a_symlinked_step(
    tmp_path, monkeypatch, caplog):
  _parallel_deletes(monkeypatch)
  loop = tr._toy_loop()
  other = tmp_path / 'other-experiment'
  with recovery.Checkpoints(other, save_every=1, keep=5) as ckpt:
    loop.run(tr._initial(loop), until_step=2, checkpoints=ckpt)
  scratch = tmp_path / 'scratch'
  scratch.mkdir()
  before = _snapshot(other)
  assert len(before) > 10
  run = tmp_path / 'run'
  run.mkdir()
  # A warm start by link, and a link where a later step would be saved.
  os.symlink('../other-experiment/2', run / '2')
  os.symlink('../scratch', run / '5')
  with caplog.at_level(logging.INFO):
    with recovery.Checkpoints(run, save_every=1, keep=1) as ckpt:
      state = ckpt.start(tr._initial(loop), resume='if_present')
      assert ckpt.resumed_from == 2  # read through the link
      loop.run(state, until_step=7, checkpoints=ckpt)
      ckpt_steps = ckpt.steps()
  assert ckpt_steps == [2, 7]  # keep=1 of this run's own; the link stays
  assert _snapshot(other) == before
  assert os.readlink(run / '2') == '../other-experiment/2'
  assert os.readlink(run / '5') == '../scratch' and not any(scratch.iterdir())
  assert sorted(p.name for p in run.iterdir()) == ['2', '5', '7']
  assert f"{run / '2'} -> {other / '2'}" in caplog.text
  assert 'never deleted or written through' in caplog.text
  assert 'Not saving step 5' in caplog.text


def test_a_step_swapped_for_a_symlink_during_a_run_is_not_deleted(
    tmp_path, monkeypatch, caplog):
  _parallel_deletes(monkeypatch)
  loop = tr._toy_loop()
  other = tmp_path / 'other-experiment'
  with recovery.Checkpoints(other, save_every=1, keep=5) as ckpt:
    loop.run(tr._initial(loop), until_step=1, checkpoints=ckpt)
  before = _snapshot(other)
  run = tmp_path / 'run'
  with caplog.at_level(logging.WARNING):
    with recovery.Checkpoints(run, save_every=1, keep=2) as ckpt:
      result = loop.run(tr._initial(loop), until_step=2, checkpoints=ckpt)
      # Step 1 was this run's; now a link into the other experiment.
      shutil.rmtree(run / '1')
      os.symlink(other / '1', run / '1')
      loop.run(result.state, until_step=4, checkpoints=ckpt)
  assert _snapshot(other) == before
  assert os.path.islink(run / '1')
  assert sorted(p.name for p in run.iterdir()) == ['1', '3', '4']
  assert 'Not deleting old checkpoint step 1' in caplog.text


def test_a_lock_file_that_is_garbage_or_a_symlink_is_refused(tmp_path):
  folder = tmp_path / 'ckpt'
  folder.mkdir()
  (folder / '.recovery-lock').write_text('{not json')
  with pytest.raises(recovery.CheckpointFolderError,
                     match=r'in use by another run \(unreadable lock content'):
    recovery.Checkpoints(folder)
  assert (folder / '.recovery-lock').read_text() == '{not json'
  # A planted link is neither followed nor written through.
  target = tmp_path / 'elsewhere'
  target.write_text('')
  (folder / '.recovery-lock').unlink()
  os.symlink(target, folder / '.recovery-lock')
  with pytest.raises(recovery.CheckpointFolderError,
                     match='must be a regular file, not a symlink'):
    recovery.Checkpoints(folder)
  assert target.read_text() == ''


def test_a_contender_holding_a_replaced_stale_lock_file_does_not_take_it(
    tmp_path):
  # The interleaving that a takeover under flock alone gets wrong: B opens
  # the stale lock file; the file is replaced (removed, and a new run D
  # creates and holds a new one); B then gets the old file's flock, with
  # the dead holder still in it. B must see that the path no longer names
  # its file and try again (and be refused by D), not take the old one.
  from recovery._src.checkpoint import lock
  folder = tmp_path / 'ckpt'
  folder.mkdir()
  path = str(folder / lock.LOCK_NAME)
  dead = subprocess.Popen([sys.executable, '-c', 'pass'])
  dead.wait(timeout=60)
  (folder / lock.LOCK_NAME).write_text(json.dumps(
      {'host': socket.gethostname(), 'pid': dead.pid, 'proc_start': '1',
       'time': 0, 'nonce': '00'}))
  fd_b = os.open(path, os.O_RDWR)
  os.remove(path)
  held_by_d = lock.FolderLock._take(path)
  try:
    info_b = {'host': socket.gethostname(), 'pid': os.getpid(), 'nonce': 'b'}
    try:
      assert lock.FolderLock._claim(path, fd_b, info_b, created=False) is None
    finally:
      os.close(fd_b)
    with pytest.raises(recovery.CheckpointFolderError,
                       match='in use by another run'):
      lock.FolderLock._take(path)
  finally:
    held_by_d.release()
  assert not os.path.exists(path)
