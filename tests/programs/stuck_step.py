"""A small jitted training loop under `multihost.step_watch()`; one process stalls in its data loader.

Usage: stuck_step.py STALL_STEP STALL_PROCESS [FLOOR]. Each step loads a
batch (process STALL_PROCESS sleeps 600 s in its loader of step
STALL_STEP), marks its arrival, and runs a jitted step whose sum over the
global batch is a cross-process collective (gloo), read back on the host.
The deadline is learned: 2 warm-up steps, 5x, at least FLOOR s (default 3).
Prints `STALL at=<time.time()>` as the stall begins and `DONE` if the loop
ends (it must not: the step deadline makes every process leave with 75).
"""

from __future__ import annotations

import sys
import time

import numpy as np

import multihost


def main() -> None:
  stall_step, stall_process = int(sys.argv[1]), int(sys.argv[2])
  floor = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)
  import jax.numpy as jnp  # noqa: PLC0415

  me = jax.process_index()
  multihost.set_step_deadline(warmup_steps=2, multiple=5, floor=floor)
  mesh = jax.make_mesh((jax.device_count(),), ('data',))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  @jax.jit
  def step(w, x):
    return w + jnp.sum(x)  # Sums every process's rows: a collective.

  def load(n):
    if n == stall_step and me == stall_process:
      print(f'STALL at={time.time():.3f}', flush=True)
      time.sleep(600)
    local = np.full((jax.local_device_count(), 4), n, np.float32)
    return jax.make_array_from_process_local_data(rows, local)

  w = jax.device_put(jnp.float32(0), replicated)
  watch = multihost.step_watch()
  for n in range(1, 1000):
    with watch.step(n):
      x = load(n)
      watch.arrived()
      w = step(w, x)
      float(w)
    if n == 3:
      print(f'LEARNED deadline={watch.deadline():.3g}', flush=True)
  print('DONE', flush=True)


if __name__ == '__main__':
  main()
