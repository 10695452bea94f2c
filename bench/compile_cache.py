"""A restart's compile time with and without JAX's persistent compilation cache: a controller program for `multihost.launch --max_restarts=1`.

Every process jit-compiles (ahead of time: lower, then compile) the value
and gradient of a deep MLP (--layers unrolled layers, 128 wide; about 7 s
of XLA compilation per process here at 400 layers), sharded over every
device of every process, runs it once, and prints how long lowering and
compiling took and how many persistent-cache hits JAX counted. On the first
attempt process 1 then exits 1, so the launcher restarts the job; the second
attempt compiles the same program again and ends 0.

  python -m multihost.launch --num_processes=2 --devices_per_process=2 \\
      --max_restarts=1 -- python bench/compile_cache.py
  JAX_ENABLE_COMPILATION_CACHE=false python -m multihost.launch \\
      --num_processes=2 --devices_per_process=2 --max_restarts=1 -- \\
      python bench/compile_cache.py            # without the cache

(The launcher gives both attempts the same $JAX_COMPILATION_CACHE_DIR.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import multihost

WIDTH = 128


def loss(params, x):
  for i, (w, b) in enumerate(params):
    x = jnp.tanh(x @ w + b) if i % 2 else jax.nn.gelu(x @ w - b)
    x = x / (1 + jnp.abs(x).mean())
  return (x**2).sum()


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--layers', type=int, default=400)
  args = p.parse_args()
  hits = []
  jax.monitoring.register_event_listener(
      lambda event, **kw: hits.append(event)
      if event == '/jax/compilation_cache/cache_hits' else None)
  multihost.initialize()
  attempt = int(os.environ.get(multihost.env.RESTART_COUNT) or 0)
  mesh = jax.make_mesh((jax.device_count(),), ('data',))
  rep = jax.sharding.NamedSharding(mesh, jax.P())
  rows = jax.sharding.NamedSharding(mesh, jax.P('data', None))
  params = [(np.full((WIDTH, WIDTH), 0.01, np.float32),
             np.zeros(WIDTH, np.float32)) for _ in range(args.layers)]
  params = jax.device_put(params, rep)
  x = np.ones((2 * jax.device_count(), WIDTH), np.float32)
  x = jax.make_array_from_callback(x.shape, rows, lambda i: x[i])
  step = jax.jit(jax.value_and_grad(loss))
  t0 = time.perf_counter()
  lowered = step.lower(params, x)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  value, _ = compiled(params, x)
  value.block_until_ready()
  print(f'[process={jax.process_index()}] attempt {attempt}: lowered in '
        f'{t1 - t0:.2f} s, compiled in {t2 - t1:.2f} s (persistent cache '
        f'hits: {len(hits)}; {multihost.env.COMPILATION_CACHE_DIR}='
        f'{os.environ.get(multihost.env.COMPILATION_CACHE_DIR, "")!r})',
        flush=True)
  multihost.sync_global_devices('compiled')
  if attempt == 0 and jax.process_index() == 1:
    sys.exit(1)  # The launcher restarts the job.


if __name__ == '__main__':
  main()
