"""A checkpoint whose leaves differ from the target's, a leaf removed or added: `CheckpointMismatchError`, and nothing is moved or set aside.

One controller, real Orbax checkpoints (recovery.Checkpoints).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import recovery


def _state(names: tuple[str, ...], step: int) -> recovery.TransitionState:
  return recovery.TransitionState(
      user={n: np.full(4, step, np.float32) for n in names},
      key=jax.random.key(0), order=np.arange(4, dtype=np.int32), cursor=0,
      epoch=0, step=step)


def _listing(folder) -> list[str]:
  return sorted(p.name for p in folder.iterdir() if not p.name.startswith('.'))


def _saved(tmp_path, saves: list[tuple[tuple[str, ...], int]]):
  folder = tmp_path / 'ckpt'
  with recovery.Checkpoints(folder, async_save=False, save_every=1) as ckpt:
    ckpt.start(_state(saves[0][0], 0), resume=False)
    for names, step in saves:
      ckpt.save(_state(names, step))
  return folder


def test_a_stored_leaf_the_target_lacks_is_a_mismatch_not_damage(tmp_path):
  # Saved with {'w'} at step 3, then {'w', 'v'} at step 6; restarted with
  # {'w'}: step 6 is no damaged step to pass over for step 3.
  folder = _saved(tmp_path, [(('w',), 3), (('w', 'v'), 6)])
  before = _listing(folder)
  assert before == ['3', '6'], before
  with recovery.Checkpoints(folder, async_save=False) as ckpt:
    with pytest.raises(recovery.CheckpointMismatchError,
                       match=r'step 6 .*does not fit this run: user/v: in the '
                       r"checkpoint \(\[\[4\], 'float32'\]\) but not in this "
                       r"run's state"):
      ckpt.start(_state(('w',), 0), resume=True)
  assert _listing(folder) == before


def test_a_target_leaf_the_checkpoint_lacks_is_a_mismatch(tmp_path):
  folder = _saved(tmp_path, [(('w',), 3)])
  with recovery.Checkpoints(folder, async_save=False) as ckpt:
    with pytest.raises(recovery.CheckpointMismatchError,
                       match=r'step 3 .*does not fit this run: user/v: '
                       r'missing from the checkpoint, this run expects '
                       r"\[\[4\], 'float32'\]"):
      ckpt.start(_state(('w', 'v'), 0), resume=True)
  assert _listing(folder) == ['3']
