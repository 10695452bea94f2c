"""Digests cover every bit of every leaf, and checkpoints of the previous digest version still verify.

With jax_enable_x64 off (the default, and in these tests), digest version 1
cast 64-bit NumPy leaves to 32 bits first: a float64's low bits and an
int64's high bits (the stored cursor, epoch and step among them) were not
covered. Version 2 digests each leaf's own bytes. Checkpoints name their
digest algorithm: one of version 1 (written here with that algorithm
forced, and checked against the digest the code before version 2 wrote for
the same state) is checked with it, in both tiers and by
bin/verify_checkpoint.py; one naming an unknown algorithm is refused with
what to do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import dtype_matrix as matrix
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

import multihost
from multihost import env as env_lib
import recovery
from recovery._src.local import folder
from recovery._src.state import digest as _digest

ROOT = pathlib.Path(__file__).resolve().parents[2]
V1 = 'multihost-leaf-digests-v1'


def _changed(value: np.ndarray, byte: int) -> np.ndarray:
  """A copy of `value` with the lowest bit of byte `byte` of its first item flipped."""
  out = np.array(value)
  out.reshape(-1).view(np.uint8)[byte] ^= 0x01
  return out


def test_every_bit_of_a_64_bit_or_scalar_leaf_is_in_its_digest():
  assert not jax.config.jax_enable_x64
  # (leaf, a byte of its first item to change): the lowest bit of a float's
  # mantissa, bit 40 (+2**40) of an integer.
  cases = {
      'float64': (np.array([1.0, 2.0]), 0),
      'int64': (np.array([3, 4], np.int64), 5),
      'uint64': (np.array([3, 4], np.uint64), 5),
      'complex128': (np.array([1 + 2j]), 8),
      '0-d float64': (np.array(1.5), 0),
      'NumPy int64 scalar': (np.int64(7), 5),
      'bfloat16': (np.array([1, 2], ml_dtypes.bfloat16), 0),
      'float8_e4m3fn': (np.array([1, 2], ml_dtypes.float8_e4m3fn), 0),
      'int4': (np.array([1, 2], ml_dtypes.int4), 0),
  }
  missed = {1: [], 2: []}
  for name, (value, byte) in cases.items():
    changed = _changed(value, byte)
    if isinstance(value, np.generic):
      changed = changed[()]
    for version in (1, 2):
      if (multihost.leaf_digests({'x': value}, version=version)
          == multihost.leaf_digests({'x': changed}, version=version)):
        missed[version].append(name)
  for name, value, changed in (('Python int', 5, 5 + 2**40),
                               ('Python float', 1.0, 1.0 + 2**-40)):
    for version in (1, 2):
      if (multihost.tree_digest(value, version=version)
          == multihost.tree_digest(changed, version=version)):
        missed[version].append(name)
  assert missed[2] == [], missed
  assert missed[1] == ['float64', 'int64', 'uint64', 'complex128',
                       '0-d float64', 'NumPy int64 scalar', 'Python int',
                       'Python float'], missed  # The gap version 2 closed.
  # The versions agree on every leaf JAX's dtypes hold as they are.
  same = {'w': np.arange(4, dtype=np.float32), 'k': jax.random.key(1),
          'b': jnp.ones(3, jnp.bfloat16), 'i': np.int32(3)}
  assert (multihost.leaf_digests(same, version=1)
          == multihost.leaf_digests(same))
  with pytest.raises(ValueError, match=r'leaf_digests: unknown digest version'
                     r' 3; this multihost computes versions \[1, 2\]. Pass '
                     'one of them, or upgrade multihost'):
    multihost.leaf_digests(same, version=3)


# -- a changed bit in a stored 64-bit leaf is named, in both tiers ------------


# The stored leaves a test changes, and the byte of the first item it flips.
_CHANGES = {'data/cursor': 5, 'data/step': 5, 'user/c128': 8, 'user/f64': 0,
            'user/i64': 5, 'user/u64': 5}


def _user(seed: int) -> dict:
  rng = np.random.default_rng(seed)
  return {'f64': rng.random(3), 'i64': rng.integers(0, 99, 3),
          'u64': rng.integers(0, 99, 3).astype(np.uint64),
          'c128': rng.random(2) + 1j * rng.random(2),
          'f32': rng.random(3).astype(np.float32)}


def _change_persistent(workdir: pathlib.Path) -> None:
  """Changes `_CHANGES` in the persistent step's state item, through Orbax (it reads back cleanly)."""
  item = workdir / 'ckpt' / str(matrix.STEP) / 'state'
  with ocp.StandardCheckpointer() as orbax:
    tree = orbax.restore(item)
    for name, byte in _CHANGES.items():
      group, leaf = name.split('/')
      tree[group][leaf] = _changed(tree[group][leaf], byte)
    orbax.save(workdir / 'altered', tree)
  shutil.rmtree(item)
  shutil.copytree(workdir / 'altered', item)


def _change_local(workdir: pathlib.Path) -> None:
  """Changes `_CHANGES` in the local step's blocks, in its data file."""
  (step,) = folder.scan(str(workdir / 'local0'))
  for key, entry in step.entries.items():
    if key[0] in _CHANGES:
      data = pathlib.Path(entry.path)
      raw = bytearray(data.read_bytes())
      raw[entry.offset + _CHANGES[key[0]]] ^= 0x01
      data.write_bytes(bytes(raw))


@pytest.mark.parametrize('tier', matrix.TIERS)
def test_a_changed_bit_in_a_stored_64_bit_leaf_or_the_cursor_is_named(
    tmp_path, tier, caplog):
  """A float64's lowest bit, or +2**40 in an int64 (the cursor, the step), fails the digest check."""
  matrix.save(str(tmp_path), tier, _user(1), _user(2))
  (_change_persistent if tier == 'persistent' else _change_local)(tmp_path)
  caplog.set_level(logging.ERROR)
  with pytest.raises(recovery.CheckpointError) as raised:
    matrix.resume(str(tmp_path), tier, _user(2))
  named = f'leaves that changed: {", ".join(sorted(_CHANGES))})'
  where = str(raised.value) if tier == 'persistent' else caplog.text
  assert named in where, where
  assert 'user/f32' not in where


# -- a checkpoint of digest version 1 --------------------------------------


def _old_state() -> recovery.TransitionState:
  """A state whose version 1 and 2 digests differ (64-bit leaves, a cursor past 2**32)."""
  user = {'f64': np.array([1.0, 2.0 + 2**-40]),
          'i64': np.array([2**40 + 1, -3], np.int64),
          'u64': np.array([2**40 + 5], np.uint64),
          'w': jnp.arange(4, dtype=jnp.float32)}
  return recovery.TransitionState(
      user=user, key=jax.random.key(0), order=np.arange(4, dtype=np.int32),
      cursor=2**40 + 3, epoch=1, step=matrix.STEP)


# `recovery.checkpoint_digest(_old_state())` by the code before digest
# version 2 (commit 3b3de9d, x64 off): what its checkpoints of that state
# store as their digest.
_OLD_DIGEST = '4b3a7487f6f3fd272b286964f4873baa62611970c5064b468f89ee950e394ff7'


@contextlib.contextmanager
def _digest_algorithm(name: str):
  """Saves made inside record (and digest by) algorithm `name`, as the version that wrote it did."""
  saved = _digest.DIGEST_ALGORITHM
  _digest.DIGEST_ALGORITHM = name
  try:
    yield
  finally:
    _digest.DIGEST_ALGORITHM = saved


def _save(ckpt: recovery.Checkpoints, state: recovery.TransitionState,
          algorithm: str, *, force: bool = False) -> None:
  with _digest_algorithm(algorithm):
    assert ckpt.save(state, force=force) or ckpt.local is not None
    ckpt.wait()


def _metas(workdir: pathlib.Path, tier: str) -> list[dict]:
  """The meta items of the tier's steps (the persistent ones, or local0's)."""
  if tier == 'persistent':
    return [json.loads(p.read_text()) for p in
            sorted((workdir / 'ckpt').glob('*/meta/metadata'))]
  return [s.manifest['meta'] for s in folder.scan(str(workdir / 'local0'))]


@pytest.mark.parametrize('tier', matrix.TIERS)
def test_a_checkpoint_of_the_previous_digest_version_restores(tmp_path,
                                                               tier):
  old = _old_state()
  fresh = old.replace(user=jax.tree.map(np.zeros_like, old.user), cursor=0,
                      epoch=0, step=0)
  with matrix.checkpoints(str(tmp_path), tier) as ckpt:
    ckpt.start(fresh, resume=False)
    _save(ckpt, old, V1)
  (meta,) = _metas(tmp_path, tier)  # (Only this tier saved.)
  assert (meta['digest_algorithm'], meta['digest']) == (V1, _OLD_DIGEST)
  assert _metas(tmp_path, 'local' if tier == 'persistent' else
                'persistent') == []
  with matrix.checkpoints(str(tmp_path), tier) as ckpt:
    got = ckpt.start(fresh, resume=True)
    assert (ckpt.resumed_tier, ckpt.resumed_from) == (tier, matrix.STEP)
  assert (got.cursor, got.epoch, got.step) == (2**40 + 3, 1, matrix.STEP)
  assert recovery.checkpoint_digest(got) == recovery.checkpoint_digest(old)
  assert recovery.checkpoint_digest(got) != _OLD_DIGEST  # Now version 2.


def _set_algorithm(workdir: pathlib.Path, tier: str, step: int,
                   name: str) -> None:
  """Rewrites the algorithm step `step`'s meta names, as a newer version would have written it."""
  if tier == 'persistent':
    path = workdir / 'ckpt' / str(step) / 'meta' / 'metadata'
    meta = json.loads(path.read_text())
    meta['digest_algorithm'] = name
    path.write_text(json.dumps(meta))
    return
  (stored,) = [s for s in folder.scan(str(workdir / 'local0'))
               if s.step == step]
  path = pathlib.Path(stored.folder) / folder.MANIFEST
  manifest = json.loads(path.read_text())
  manifest['meta']['digest_algorithm'] = name
  path.write_text(json.dumps(manifest))


@pytest.mark.parametrize('tier', matrix.TIERS)
def test_a_checkpoint_of_an_unknown_digest_version_says_what_to_do(
    tmp_path, tier):
  """Refused on start, even where damaged steps are set aside for older ones: a newer version can read it."""
  newer = 2 * matrix.STEP
  with matrix.checkpoints(str(tmp_path), tier) as ckpt:
    ckpt.start(matrix.state(_user(2), 0), resume=False)
    for step in (matrix.STEP, newer):
      ckpt.save(matrix.state(_user(step), step))
  _set_algorithm(tmp_path, tier, newer, 'multihost-leaf-digests-v3')
  with pytest.raises(recovery.CheckpointError,
                     match=rf"step {newer} in .* was digested with "
                     r"'multihost-leaf-digests-v3', which this version of "
                     r'recovery cannot check \(it checks multihost-leaf-'
                     r'digests-v1, multihost-leaf-digests-v2\). A newer '
                     r'version wrote it: upgrade multihost on every process '
                     r'to restore it'):
    with matrix.checkpoints(str(tmp_path), tier) as ckpt:
      ckpt.start(matrix.state(_user(2), 0), resume='if_present')
  assert list(tmp_path.rglob('*damaged*')) == []
  assert sorted(m['step'] for m in _metas(tmp_path, tier)) == [
      matrix.STEP, newer]


def test_verify_checkpoint_reads_both_digest_versions(tmp_path):
  """bin/verify_checkpoint.py checks a version 1 and a version 2 step, and names an unknown one."""
  old = _old_state()
  later = old.replace(step=2 * matrix.STEP)
  newest = old.replace(step=3 * matrix.STEP)
  with recovery.Checkpoints(tmp_path / 'ckpt', async_save=False) as ckpt:
    ckpt.start(old.replace(step=0), resume=False)
    _save(ckpt, old, V1, force=True)
    _save(ckpt, later, _digest.DIGEST_ALGORITHM, force=True)
    _save(ckpt, newest, _digest.DIGEST_ALGORITHM, force=True)
  _set_algorithm(tmp_path, 'persistent', newest.step,
                 'multihost-leaf-digests-v3')
  done = subprocess.run(
      [sys.executable, str(ROOT / 'bin' / 'verify_checkpoint.py'),
       f'--checkpoint_dir={tmp_path / "ckpt"}'],
      capture_output=True, text=True, timeout=300,
      env={**os.environ, env_lib.PLATFORMS: 'cpu'})
  out = done.stdout + done.stderr
  lines = done.stdout.splitlines()
  assert done.returncode == 1, out
  assert (f'step 4: OK epoch 1 cursor {2**40 + 3} digest {_OLD_DIGEST[:16]} '
          f'({V1})') in lines[2], out
  assert '(multihost-leaf-digests-v2)' in lines[3] and 'step 8: OK' in (
      lines[3]), out
  assert lines[4].startswith(
      'step 12: FAIL CheckpointError: [process=0] Checkpoint step 12 in '), out
  assert ("was digested with 'multihost-leaf-digests-v3'" in lines[4]
          and 'A newer version wrote it' in lines[4]), out
  assert 'FAIL: 1 of 3 checkpoints are bad.' in done.stdout, out
