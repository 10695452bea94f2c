"""Low-precision and every other dtype through the checkpoint tiers, bit for bit, in one controller.

The dtype x kind x tier matrix (tests/dtype_matrix.py) on 4 CPU devices: the
persistent tier and the local tier; the local tier's peer copies need hosts
of their own (tests/multiprocess/test_dtypes_processes.py). A bit flipped in
a low-precision leaf on disk is named by the digest check, and a NumPy leaf
of a dtype no checkpoint holds is refused with the reason.
"""

from __future__ import annotations

import json
import logging
import pathlib
import shutil

import dtype_matrix as matrix
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import recovery
from recovery._src.checkpoint import carrier
from recovery._src.local import folder
from recovery._src.state import leaves


@pytest.mark.parametrize('tier', matrix.TIERS)
def test_every_dtype_and_kind_restores_with_its_dtype_and_bits(tmp_path, tier):
  saved, target = matrix.user(1), matrix.user(2)
  digest = matrix.save(str(tmp_path), tier, saved, target)
  got, took, step, _ = matrix.resume(str(tmp_path), tier, target)
  assert (took, step) == (tier, matrix.STEP)
  assert matrix.differences(saved, got.user) == []
  assert recovery.checkpoint_digest(got) == digest
  # The matrix is what it says: 24 JAX dtypes x 3 kinds, 4 NumPy-only.
  assert sum(map(len, saved.values())) == 3 * len(matrix.JAX_DTYPES) + 4
  assert {'bfloat16', 'float16', 'float8_e4m3fn', 'float8_e5m2', 'int4',
          'uint4', 'int8', 'bool', 'complex64'} <= set(matrix.JAX_DTYPES)


@pytest.mark.parametrize('tier', matrix.TIERS)
def test_carried_dtypes_keep_a_one_device_sharding(tmp_path, tier):
  """A mesh of one device (one TPU chip): the sharding comes back as it was."""
  mesh = jax.make_mesh((1,), ('d',), devices=jax.devices()[:1])
  names = ['uint4', 'float8_e4m3', 'bfloat16']
  saved = matrix.user(1, names=names, kinds=['committed'], mesh=mesh)
  target = matrix.user(2, names=names, kinds=['committed'], mesh=mesh)
  matrix.save(str(tmp_path), tier, saved, target)
  got, took, _, _ = matrix.resume(str(tmp_path), tier, target)
  assert took == tier and matrix.differences(saved, got.user) == []


def test_a_persistent_checkpoint_names_the_leaves_own_dtypes(tmp_path):
  """uint4 travels in uint8 through TensorStore; the checkpoint says uint4."""
  names = ['uint4', 'float8_e4m3', 'bfloat16']
  saved = matrix.user(1, names=names)
  matrix.save(str(tmp_path), 'persistent', saved, matrix.user(2, names=names))
  assert [carrier.carrier(matrix.dtype(n)) for n in names] == [
      np.dtype(np.uint8), np.dtype(np.uint8), None]
  with recovery.Checkpoints(tmp_path / 'ckpt', read_only=True) as ckpt:
    meta = ckpt.read_meta(matrix.STEP)
    tree = ckpt.stored_tree(matrix.STEP)
    # What bin/verify_checkpoint.py restores (no model at hand): NumPy
    # leaves of the stored dtypes; the digest check passes.
    restored = ckpt.restore(recovery.TransitionState(
        user=tree['user'], key=jax.random.wrap_key_data(
            np.asarray(tree['data']['key'])), order=tree['data']['order'],
        cursor=0, epoch=0, step=0), step=matrix.STEP)
  for name in names:
    for kind in matrix.KINDS:
      got = restored.user[name][kind]
      assert isinstance(got, np.ndarray) and got.dtype == matrix.dtype(name)
      assert got.tobytes() == matrix.host_bytes(saved[name][kind])
  for name in names:
    for kind in matrix.KINDS:
      assert meta['leaves'][f'user/{name}/{kind}'][1] == name
      assert tree['user'][name][kind].dtype == matrix.dtype(name)


def _natively(monkeypatch, dtype_name: str, answer: bool) -> None:
  """Our carrier module's answer to "does TensorStore store `dtype_name` itself" is `answer` (others as installed)."""
  real = carrier.stores_natively.__wrapped__
  monkeypatch.setattr(
      carrier, 'stores_natively',
      lambda d: answer if np.dtype(d).name == dtype_name else real(d))


@pytest.mark.parametrize('name,at_save,at_restore,stored', [
    # Saved in a carrier (as a TensorStore that refuses it would), restored
    # where TensorStore stores it: read as the uint8 it was written in.
    ('float8_e4m3fn', False, True, 'uint8'),
    # Saved in a carrier (the installed TensorStore refuses them), restored
    # where TensorStore is said to store them.
    ('float8_e4m3', None, True, 'uint8'),
    ('uint4', None, True, 'uint8')])
def test_a_leaf_restores_as_it_was_stored_whatever_tensorstore_says_now(
    tmp_path, monkeypatch, name, at_save, at_restore, stored):
  names = [name, 'bfloat16']
  saved, target = matrix.user(1, names=names), matrix.user(2, names=names)
  with monkeypatch.context() as saving:
    if at_save is not None:
      _natively(saving, name, at_save)
    digest = matrix.save(str(tmp_path), 'persistent', saved, target)
  with recovery.Checkpoints(tmp_path / 'ckpt', read_only=True) as ckpt:
    storage = ckpt.read_meta(matrix.STEP)['storage']
  assert {k: v for k, v in storage.items() if k.startswith('user/')} == {
      **{f'user/{name}/{kind}': stored for kind in matrix.KINDS},
      **{f'user/bfloat16/{kind}': 'bfloat16' for kind in matrix.KINDS}}
  _natively(monkeypatch, name, at_restore)
  got, took, step, _ = matrix.resume(str(tmp_path), 'persistent', target)
  assert (took, step) == ('persistent', matrix.STEP)
  assert matrix.differences(saved, got.user) == []
  assert recovery.checkpoint_digest(got) == digest
  # Nothing set aside as damaged.
  assert sorted(p.name for p in (tmp_path / 'ckpt').iterdir()
                if not p.name.startswith('.')) == [str(matrix.STEP)]


def test_a_leaf_saved_as_itself_where_tensorstore_now_refuses_it_is_no_damage(
    tmp_path, monkeypatch):
  # Saved as itself; the TensorStore here is said not to store it (an
  # older one): an error that says so, and nothing set aside as damaged.
  names = ['float8_e4m3fn']
  saved, target = matrix.user(1, names=names), matrix.user(2, names=names)
  matrix.save(str(tmp_path), 'persistent', saved, target)
  _natively(monkeypatch, 'float8_e4m3fn', False)
  with pytest.raises(recovery.CheckpointError,
                     match='was saved as float8_e4m3fn by a TensorStore that '
                     'stores float8_e4m3fn; the TensorStore installed here'):
    matrix.resume(str(tmp_path), 'persistent', target)
  assert sorted(p.name for p in (tmp_path / 'ckpt').iterdir()
                if not p.name.startswith('.')) == [str(matrix.STEP)]


def test_a_checkpoint_without_the_storage_record_restores_by_todays_rule(
    tmp_path):
  names = ['uint4', 'float8_e4m3', 'bfloat16']
  saved, target = matrix.user(1, names=names), matrix.user(2, names=names)
  digest = matrix.save(str(tmp_path), 'persistent', saved, target)
  meta_files = list((tmp_path / 'ckpt' / str(matrix.STEP)).glob(
      'meta/metadata'))
  assert len(meta_files) == 1, list((tmp_path / 'ckpt').rglob('*'))
  text = json.loads(meta_files[0].read_text())
  del text['storage']  # As written before the record existed.
  meta_files[0].write_text(json.dumps(text))
  got, took, _, _ = matrix.resume(str(tmp_path), 'persistent', target)
  assert took == 'persistent' and matrix.differences(saved, got.user) == []
  assert recovery.checkpoint_digest(got) == digest


def test_local_manifests_name_ml_dtypes_by_name(tmp_path):
  names = ['bfloat16', 'float8_e5m2', 'int4', 'float32']
  saved = matrix.user(1, names=names, kinds=['numpy'])
  matrix.save(str(tmp_path), 'local', saved, matrix.user(2, names=names,
                                                         kinds=['numpy']))
  (step,) = folder.scan(str(tmp_path / 'local0'))
  dtypes = {k[0]: e.dtype for k, e in step.entries.items()}
  assert {n: dtypes[f'user/{n}/numpy'] for n in names} == {
      'bfloat16': 'bfloat16', 'float8_e5m2': 'float8_e5m2', 'int4': 'int4',
      'float32': '<f4'}
  assert all(leaves.dtype_of(t) == matrix.dtype(n)
             for n, t in zip(names, ['bfloat16', 'float8_e5m2', 'int4',
                                     '<f4'], strict=True))


# -- a flipped bit is named by the digest check -------------------------------


def _flip(raw: bytearray, offset: int) -> None:
  raw[offset] ^= 0x01  # The lowest bit of the item's first byte.


@pytest.mark.parametrize('name', ['bfloat16', 'float8_e4m3fn', 'int4'])
def test_a_flipped_bit_in_a_low_precision_local_block_is_named(
    tmp_path, name, caplog):
  names = [name, 'float32']
  saved = matrix.user(1, names=names)
  target = matrix.user(2, names=names)
  matrix.save(str(tmp_path), 'local', saved, target)
  (step,) = folder.scan(str(tmp_path / 'local0'))
  entry = next(e for k, e in sorted(step.entries.items())
               if k[0] == f'user/{name}/committed')
  data = pathlib.Path(entry.path)
  raw = bytearray(data.read_bytes())
  _flip(raw, entry.offset)
  data.write_bytes(bytes(raw))
  caplog.set_level(logging.ERROR)
  with pytest.raises(recovery.CheckpointError):
    matrix.resume(str(tmp_path), 'local', target)
  assert (f'leaves that changed: user/{name}/committed)' in caplog.text
          ), caplog.text


@pytest.mark.parametrize('name', ['bfloat16', 'uint4'])
def test_a_flipped_bit_in_a_low_precision_persistent_leaf_is_named(
    tmp_path, name):
  """A bit changed through TensorStore reads cleanly; the digest sees it.

  uint4 is stored in a uint8 carrier: its low bit is the value's.
  """
  names = [name, 'float32']
  saved = matrix.user(1, names=names, kinds=['numpy'])
  target = matrix.user(2, names=names, kinds=['numpy'])
  matrix.save(str(tmp_path), 'persistent', saved, target)
  item = tmp_path / 'ckpt' / str(matrix.STEP) / 'state'
  with ocp.StandardCheckpointer() as orbax:
    tree = orbax.restore(item)
    leaf = np.array(tree['user'][name]['numpy'])
    raw = bytearray(leaf.tobytes())
    _flip(raw, 0)
    tree['user'][name]['numpy'] = np.frombuffer(
        bytes(raw), leaf.dtype).reshape(leaf.shape)
    orbax.save(tmp_path / 'altered', tree)
  shutil.rmtree(item)
  shutil.copytree(tmp_path / 'altered', item)
  with pytest.raises(recovery.CheckpointCorruptError,
                     match=rf'fails its digest check.*leaves that changed: '
                     rf'user/{name}/numpy\)'):
    matrix.resume(str(tmp_path), 'persistent', target)


# -- what cannot be checkpointed says why ------------------------------------


@pytest.mark.parametrize('leaf, said', [
    (np.array(['x']), 'dtype <U1 (text)'),
    (np.array([b'x']), 'dtype |S1 (byte strings)'),
    (np.array([object()]), 'dtype object (Python objects)'),
    (np.zeros(2, 'V4'), 'dtype |V4 (raw bytes)'),
    (np.zeros(2, [('a', 'i4')]), "dtype [('a', '<i4')] (records)"),
    (np.array(['2026-01-01'], 'datetime64[D]'), 'dtype datetime64[D] (dates)'),
    (np.zeros(2, np.longdouble), 'dtype float128 (extended precision, 128 '
     'bits)'),
])
def test_an_unsupported_numpy_leaf_names_its_dtype_and_why(
    tmp_path, leaf, said):
  if leaf.dtype.itemsize != 16 and leaf.dtype.kind == 'f':
    pytest.skip(f'np.longdouble is {leaf.dtype} here, no extended precision')
  state = matrix.state({'params': {'w': jnp.zeros(2, jnp.bfloat16),
                                   'bad': leaf}}, 0)
  with recovery.Checkpoints(tmp_path / 'ckpt') as ckpt:
    with pytest.raises(recovery.CheckpointError) as e:
      ckpt.save(state, force=True)
  message = str(e.value)
  assert f'user/params/bad is a numpy.ndarray of {said}' in message, message
  assert 'bfloat16' in message and 'make it a static field' in message


def test_low_precision_digests_are_of_the_raw_bits():
  """A leaf's digest changes with any bit of a low-precision item, and is the same for a NumPy and a jax.Array holding the same bits."""
  for name in ('bfloat16', 'float8_e4m3fn', 'float8_e5m2', 'int4', 'uint4',
               'float4_e2m1fn', 'int2'):
    value = matrix.random_bits(name, (6,), np.random.default_rng(0))
    flipped = value.copy()
    flipped.view(np.uint8)[3] ^= 0x01
    on_device = jax.device_put(value, jax.devices()[1])
    digests = [recovery.checkpoint_leaf_digests({'w': x})['w']
               for x in (value, on_device, jnp.asarray(value), flipped)]
    assert digests[0] == digests[1] == digests[2] != digests[3], name


def test_the_matrix_script_prints_a_line_per_dtype_and_tier(
    tmp_path, monkeypatch, capsys):
  """The script an accelerator runs (docs/recovery.md states its result)."""
  monkeypatch.setattr('sys.argv', ['dtype_matrix.py', str(tmp_path),
                                   'uint4', 'bfloat16'])
  with pytest.raises(SystemExit) as done:
    matrix.main()
  out = capsys.readouterr().out
  assert done.value.code == 0, out
  for tier in matrix.TIERS:
    for name in ('uint4', 'bfloat16'):
      assert f'OK {tier} {name} (committed, uncommitted, numpy)' in out, out
  assert '12 leaves restored bit for bit; 0 dtype x tier cases failed' in out
