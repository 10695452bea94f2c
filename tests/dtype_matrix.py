"""Every dtype JAX arrays take, through recovery's checkpoint tiers, bit for bit.

A state holds one leaf per dtype and kind: a committed jax.Array (sharded
over every device), an uncommitted one, and a NumPy (ml_dtypes) array, each
filled with random bits (NaN payloads, infinities and subnormals included;
for 4- and 2-bit types their valid patterns). It is saved to one tier, then
a fresh run (a target of the same dtypes and kinds with other bits) resumes
with `start(..., resume=True)`; every leaf must come back with its type,
dtype, commitment, sharding and bits.

Used in-process by tests/unit/test_dtypes.py (one controller, 4 CPU
devices) and by tests/programs/dtype_states.py (2 controllers, peer copies);
as a script on an accelerator, one process, the persistent and local tiers
with a state per dtype (so one dtype a backend refuses does not hide the
others), one line each and a summary:

  python tests/dtype_matrix.py WORKDIR [DTYPE ...]

Without DTYPEs, a backend's `ABORTS` are left out (named: tried).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import recovery

# Every dtype a jax.Array takes without jax_enable_x64 (those this JAX has).
JAX_DTYPES = tuple(n for n in (
    'bool', 'int2', 'uint2', 'int4', 'uint4', 'int8', 'uint8', 'int16',
    'uint16', 'int32', 'uint32', 'float4_e2m1fn', 'float8_e3m4',
    'float8_e4m3', 'float8_e4m3b11fnuz', 'float8_e4m3fn', 'float8_e4m3fnuz',
    'float8_e5m2', 'float8_e5m2fnuz', 'float8_e8m0fnu', 'bfloat16',
    'float16', 'float32', 'complex64') if hasattr(jnp, n))
# NumPy leaves may also be 64-bit.
NUMPY_ONLY = ('int64', 'uint64', 'float64', 'complex128')
# Dtypes whose arrays end the process on a backend (a C++ abort, no Python
# error): a run there leaves them out unless they are named, and says why.
ABORTS = {'tpu': (('int2', 'uint2'), "XLA's TPU compiler aborted the process "
                  'on the matrix\'s int2 and uint2 arrays (Check failed: '
                  'other.amount_ != 0; JAX 0.10.2, TPU v5e), before any '
                  'checkpoint')}
KINDS = ('committed', 'uncommitted', 'numpy')
TIERS = ('persistent', 'local')
STEP = 4


def dtype(name: str) -> np.dtype:
  return np.dtype(jnp.dtype(name))


def bits(d: np.dtype) -> int:
  """The bits an item of `d` uses (4 for int4, in its byte)."""
  if d == np.bool_:
    return 1
  for info in (ml_dtypes.finfo, ml_dtypes.iinfo):
    try:
      return info(d).bits
    except ValueError:
      pass
  return 8 * d.itemsize  # complex


def random_bits(name: str, shape: tuple[int, ...],
                rng: np.random.Generator) -> np.ndarray:
  """An array of dtype `name` holding random (valid) bit patterns."""
  d = dtype(name)
  n = bits(d)
  raw = rng.integers(0, 256, size=(*shape, d.itemsize), dtype=np.uint8)
  if n < 8:  # A sub-byte type: its low bits, the rest zero.
    raw[..., 0] &= (1 << n) - 1
  return raw.view(d).reshape(shape)


def leaf(name: str, kind: str, rng: np.random.Generator,
         sharding: jax.sharding.Sharding) -> Any:
  rows = sharding.mesh.size * int(rng.integers(1, 3))
  shape = (rows, int(rng.integers(1, 4))) if kind == 'committed' else (
      int(rng.integers(0, 2)) * (int(rng.integers(1, 6)),))  # 0-d or 1-d
  value = random_bits(name, shape, rng)
  if kind == 'numpy':
    return value
  if kind == 'uncommitted':
    return jnp.asarray(value)
  return _placed(value, sharding)


def _placed(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """`value` on `sharding` (several processes: no equality check across them, which NaNs would fail)."""
  return jax.make_array_from_callback(value.shape, sharding,
                                      lambda index: value[index])


def user(seed: int, *, names=None, kinds=KINDS, mesh=None) -> dict:
  """{dtype name: {kind: leaf}}; the same shapes for every seed."""
  mesh = mesh or jax.make_mesh((jax.device_count(),), ('d',))
  rows = jax.NamedSharding(mesh, jax.P('d'))
  out = {}
  for i, name in enumerate(names or (*JAX_DTYPES, *NUMPY_ONLY)):
    shapes = np.random.default_rng(i)  # the shapes: one per dtype
    fill = np.random.default_rng([seed, i])  # the bits: one per seed
    out[name] = {}
    for kind in kinds:
      if name in NUMPY_ONLY and kind != 'numpy':
        continue
      value = leaf(name, kind, shapes, rows)
      out[name][kind] = _refill(value, fill)
  return out


def _refill(value: Any, rng: np.random.Generator) -> Any:
  """`value` with new random bits: its kind, dtype, shape and placement."""
  name = np.dtype(value.dtype).name
  bits_ = random_bits(name, value.shape, rng)
  if isinstance(value, np.ndarray):
    return bits_
  if not value.committed:
    return jnp.asarray(bits_)
  return _placed(bits_, value.sharding)


def state(user_tree: dict, step: int) -> recovery.TransitionState:
  return recovery.TransitionState(
      user=user_tree, key=jax.random.key(0),
      order=np.arange(4, dtype=np.int32), cursor=0, epoch=0, step=step)


def checkpoints(workdir: str, tier: str) -> recovery.Checkpoints:
  """The tier's Checkpoints: `tier`'s save at STEP, the other tier none."""
  local = {}
  if tier.startswith('local'):
    local = {'local_directory': os.path.join(
        workdir, f'local{jax.process_index()}'),
             'local_save_every': STEP}
  return recovery.Checkpoints(
      os.path.join(workdir, 'ckpt'), async_save=False,
      save_every=STEP if tier == 'persistent' else 1000, **local)


def save(workdir: str, tier: str, saved: dict, target: dict) -> str:
  """Saves `saved` at STEP to `tier` (a fresh run on target `target`); returns its digest."""
  with checkpoints(workdir, tier) as ckpt:
    ckpt.start(state(target, 0), resume=False)
    ckpt.save(state(saved, STEP))
  return recovery.checkpoint_digest(state(saved, STEP))


def resume(workdir: str, tier: str, target: dict):
  """(restored state, resumed_tier, resumed_from, bytes from peers)."""
  with checkpoints(workdir, tier) as ckpt:
    got = ckpt.start(state(target, 0), resume=True)
    peers = (ckpt.local.restored_bytes_from_peers if ckpt.local is not None
             else 0)
    return got, ckpt.resumed_tier, ckpt.resumed_from, peers


def host_bytes(x: Any) -> bytes:
  """A leaf's global value's bytes on this host (every process's shards)."""
  return np.asarray(recovery.host_value(x)).tobytes()


def differences(saved: dict, restored: dict) -> list[str]:
  """'<dtype>/<kind>: what differs' for each leaf not restored as saved.

  Collective when a leaf is sharded across processes (its bits are
  gathered): every process must call this, in the same order.
  """
  out = []
  for name, kinds in saved.items():
    for kind, want in kinds.items():
      got = restored[name][kind]
      where = f'{name}/{kind}'
      if type(got) is not type(want) and not (
          isinstance(got, jax.Array) and isinstance(want, jax.Array)):
        out.append(f'{where}: a {type(got).__name__}, not a '
                   f'{type(want).__name__}')
        continue
      if np.dtype(got.dtype) != np.dtype(want.dtype):
        out.append(f'{where}: dtype {got.dtype}, not {want.dtype}')
        continue
      if isinstance(want, jax.Array):
        if got.committed != want.committed:
          out.append(f'{where}: committed {got.committed}')
        if want.committed and got.sharding != want.sharding:
          out.append(f'{where}: sharding {got.sharding}')
      if host_bytes(got) != host_bytes(want):
        out.append(f'{where}: other bits')
  return out


def main() -> None:
  """One process: each dtype alone through each tier; one line each."""
  workdir, names = sys.argv[1], sys.argv[2:] or (*JAX_DTYPES, *NUMPY_ONLY)
  print(f'backend {jax.default_backend()}: {jax.devices()[0].device_kind} '
        f'x {jax.device_count()}', flush=True)
  aborts, why = ABORTS.get(jax.default_backend(), ((), ''))
  if not sys.argv[2:] and aborts:
    names = [n for n in names if n not in aborts]
    print(f'SKIP {" ".join(aborts)}: {why}; name them to try.', flush=True)
  passed, failed, t0 = 0, [], time.monotonic()
  for tier in TIERS:
    for name in names:
      where = os.path.join(workdir, f'{tier}-{name}')
      saved = {}
      try:
        saved, target = user(1, names=[name]), user(2, names=[name])
        save(where, tier, saved, target)
        got, took, step, _ = resume(where, tier, target)
        bad = differences(saved, got.user)
        if (took, step) != (tier, STEP):
          bad.append(f'resumed from the {took} tier at step {step}')
      except Exception as e:  # pylint: disable=broad-except
        bad = [f'{type(e).__name__}: {str(e)[:300]}']
      if bad:
        failed.append((tier, name, bad))
        print(f'FAIL {tier} {name}: {"; ".join(bad)}', flush=True)
      else:
        passed += len(saved[name])
        print(f'OK {tier} {name} ({", ".join(saved[name])})', flush=True)
  print(f'{passed} leaves restored bit for bit; {len(failed)} dtype x tier '
        f'cases failed; {time.monotonic() - t0:.1f} s', flush=True)
  sys.exit(1 if failed else 0)


if __name__ == '__main__':
  main()
