"""Checkpoint folders under faults: two trainers, foreign folders, crashed saves."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import recovery
import test_recovery as tr

_HOLD = textwrap.dedent('''
    import sys, time
    import recovery
    with recovery.Checkpoints(sys.argv[1]) as ckpt:
      print('HOLDING', flush=True)
      time.sleep(120)
''')


def _holder(tmp_path, directory):
  script = tmp_path / 'hold.py'
  script.write_text(_HOLD)
  proc = subprocess.Popen([sys.executable, str(script), str(directory)],
                          stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == 'HOLDING'
  return proc


def _listing(directory):
  return sorted(os.path.relpath(os.path.join(d, f), directory)
                for d, _, files in os.walk(directory) for f in files
                if not f.startswith('.recovery-lock'))


def test_a_second_run_is_refused_naming_the_holder_and_loses_nothing(tmp_path):
  loop, directory, final = tr._saved_run(tmp_path)
  before = _listing(directory)
  holder = _holder(tmp_path, directory)
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
