"""Low-precision states through the local tier's peer copies, in several controllers.

Each controller is a host of its own ($RECOVERY_HOST_ID=host<P>, a local
folder each: WORKDIR/local<P>). Usage:

  dtype_states.py matrix WORKDIR
      tests/dtype_matrix.py's state (every dtype x committed sharded across
      the processes / uncommitted / NumPy) saved to the local tier; process
      1's local folder is then deleted, and a fresh run resumes with
      start(resume=True): process 1's blocks come from its peer. Prints
      `process P: resumed TIER STEP, PEERS bytes from peers, differences
      [...]`.
  dtype_states.py drill WORKDIR STEPS KILL_AFTER
      bfloat16 weights and momentum sharded across the processes, trained
      with a local step every 3 steps (and a persistent one every 100);
      on the first attempt process 1 deletes its local folder after step
      KILL_AFTER and SIGKILLs itself; under `multihost.launch
      --max_restarts=1` the restart resumes from the local tier (process 1
      from its peer). Prints `process P: resumed TIER STEP, PEERS bytes from
      peers` and `final step S digest D` (0 for KILL_AFTER: no kill).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import multihost  # noqa: E402

multihost.initialize()

import dtype_matrix as matrix  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import recovery  # noqa: E402

ME = jax.process_index()


def _matrix(workdir: str) -> None:
  saved, target = matrix.user(1), matrix.user(2)
  matrix.save(workdir, 'local-peers', saved, target)
  if ME == 1:  # A replaced host: its local disk is empty.
    shutil.rmtree(os.path.join(workdir, 'local1'))
  multihost.sync_global_devices('wiped')
  got, tier, step, peers = matrix.resume(workdir, 'local-peers', target)
  bad = matrix.differences(saved, got.user)  # Collective (sharded leaves).
  print(f'process {ME}: resumed {tier} {step}, {peers} bytes from peers, '
        f'differences {bad}', flush=True)


WIDTH, SAMPLES, BATCH = 16, 32, 8


def _loop(sharding) -> recovery.ResilientLoop:
  rng = np.random.default_rng(0)
  x = rng.normal(size=(SAMPLES, WIDTH)).astype(np.float32)
  y = x @ np.linspace(-1, 1, WIDTH, dtype=np.float32)
  rep = jax.sharding.NamedSharding(sharding.mesh, jax.P())

  def step(user, batch):
    xs, ys = batch
    def loss_fn(w):
      return jnp.mean((xs @ w.astype(jnp.float32) - ys) ** 2)
    loss, g = jax.value_and_grad(loss_fn)(user['w'])
    m = (0.9 * user['m'].astype(jnp.float32) + g).astype(jnp.bfloat16)
    w = (user['w'].astype(jnp.float32)
         - 0.05 * m.astype(jnp.float32)).astype(jnp.bfloat16)
    return {'w': w, 'm': m}, loss

  step_fn = jax.jit(step, out_shardings=({'w': sharding, 'm': sharding}, rep))

  def data_fn(ids):
    return jax.device_put(x[ids], rep), jax.device_put(y[ids], rep)

  return recovery.ResilientLoop(
      step_fn, data_fn=data_fn, sampler=recovery.EpochSampler(SAMPLES, BATCH))


def _drill(workdir: str, steps: int, kill_after: int) -> None:
  mesh = jax.make_mesh((jax.device_count(),), ('d',))
  rows = jax.NamedSharding(mesh, jax.P('d'))
  loop = _loop(rows)
  zeros = np.zeros(WIDTH, jnp.bfloat16)
  initial = loop.init({'w': jax.device_put(zeros, rows),
                       'm': jax.device_put(zeros, rows)}, jax.random.key(7))
  local = os.path.join(workdir, f'local{ME}')
  first = os.environ.get(multihost.env.RESTART_COUNT, '0') in ('', '0')

  def on_step(state, record):
    del state
    if record.step == kill_after and first and ME == 1:
      ckpt.local.wait()  # The newest local step is written whole.
      shutil.rmtree(local)  # A replaced host: its local disk is empty.
      print(f'process {ME}: SIGKILL after step {record.step}', flush=True)
      os.kill(os.getpid(), signal.SIGKILL)

  with recovery.Checkpoints(os.path.join(workdir, 'ckpt'), save_every=100,
                            local_directory=local,
                            local_save_every=3) as ckpt:
    start = ckpt.start(initial, resume='if_present')
    if ckpt.resumed_from is not None:
      print(f'process {ME}: resumed {ckpt.resumed_tier} {ckpt.resumed_from}, '
            f'{ckpt.local.restored_bytes_from_peers} bytes from peers',
            flush=True)
    result = loop.run(start, until_step=steps, checkpoints=ckpt,
                      on_step=on_step)
  state = result.state
  assert state.user['w'].dtype == jnp.bfloat16, state.user['w'].dtype
  print(f'final step {state.step} digest '
        f'{recovery.checkpoint_digest(state)}', flush=True)


def main() -> None:
  mode, workdir = sys.argv[1], sys.argv[2]
  if mode == 'matrix':
    _matrix(workdir)
  else:
    _drill(workdir, int(sys.argv[3]), int(sys.argv[4]))


if __name__ == '__main__':
  main()
