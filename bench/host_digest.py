r"""Time and CPU of one process's leaf digests: a 1 GiB state and a small one.

  python bench/host_digest.py [--rounds=5] [--mib=1024]

One process, no `jax.distributed`. Each case digests a state with
`multihost.leaf_digests` (the 1 GiB states, in 16 leaves: NumPy float64,
NumPy float32, jax.Array float32) or with `recovery.checkpoint_digest` (a
small `TransitionState`: 20 leaves of 1-4 KiB and the int64 cursor, epoch
and step). Prints per case the median wall time and the median CPU time of
the process (every thread: the CRC-32s run on two) over `--rounds` calls,
after one warm call, and the load average.
"""

from __future__ import annotations

import os
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import multihost
import recovery

_ROUNDS = flags.DEFINE_integer('rounds', 5, 'Timed calls per case.')
_MIB = flags.DEFINE_integer('mib', 1024, 'Size of the large states.')


def _large(kind: str, mib: int) -> dict:
  leaves = 16
  dtype = np.float64 if kind == 'numpy-f64' else np.float32
  items = (mib << 20) // leaves // np.dtype(dtype).itemsize
  rng = np.random.default_rng(0)
  out = {}
  for i in range(leaves):
    value = rng.random(items, dtype=np.float64).astype(dtype)
    out[f'w{i}'] = jnp.asarray(value) if kind == 'jax-f32' else value
  return out


def _small() -> recovery.TransitionState:
  rng = np.random.default_rng(0)
  user = {f'p{i}': (rng.random(256 * (1 + i % 4), dtype=np.float32)
                    if i % 2 else jnp.ones(256 * (1 + i % 4), jnp.float32))
          for i in range(20)}
  return recovery.TransitionState(
      user=user, key=jax.random.key(0), order=np.arange(64, dtype=np.int32),
      cursor=2**40 + 3, epoch=5, step=123)


def _time(call, rounds: int) -> tuple[float, float]:
  call()  # warm
  walls, cpus = [], []
  for _ in range(rounds):
    w0, c0 = time.perf_counter(), time.process_time()
    call()
    walls.append(time.perf_counter() - w0)
    cpus.append(time.process_time() - c0)
  return statistics.median(walls), statistics.median(cpus)


def main(argv):
  del argv  # Unused.
  rounds, mib = _ROUNDS.value, _MIB.value
  print(f'load {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; '
        f'x64 {jax.config.jax_enable_x64}; rounds {rounds}', flush=True)
  for kind in ('numpy-f64', 'numpy-f32', 'jax-f32'):
    state = _large(kind, mib)
    wall, cpu = _time(lambda s=state: multihost.leaf_digests(s), rounds)
    print(f'{kind:10} {mib} MiB: wall {wall * 1e3:8.1f} ms  cpu '
          f'{cpu * 1e3:8.1f} ms', flush=True)
    del state
  small = _small()
  wall, cpu = _time(lambda: recovery.checkpoint_digest(small), rounds * 40)
  print(f'small state (24 leaves): wall {wall * 1e6:8.1f} us  cpu '
        f'{cpu * 1e6:8.1f} us', flush=True)
  print(f'load {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}',
        flush=True)


if __name__ == '__main__':
  app.run(main)
