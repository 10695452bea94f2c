r"""Costs beside a training step, in one process: the loop, the conversions, a checkpoint.

  python bench/beside_step.py --parts=loop,convert,checkpoint
  python bench/beside_step.py --parts=check   # overlap_check on against off

One controller, no `jax.distributed` (it runs where no socket can be
opened, as on a TPU machine here); every comparison in interleaved rounds
(the side that goes first alternates), medians over rounds:

* `loop`: `recovery.ResilientLoop.run` (no checkpoints, the step deadline
  on) against a bare loop of the same jitted step (a 4-layer MLP, Adam) on
  the same batches (`data_fn(ids)` puts each batch on the devices): the
  bare loop dispatches every step and blocks once at the end. Each round
  times `--steps` steps of each, from the same state.
* `convert`: `multihost.host_local_array_to_global_array` and
  `global_array_to_host_local_array` against
  `jax.experimental.multihost_utils`'s, for float32 batches of `--sizes`
  sharded over a mesh of all devices (`P('data')`); each timed call waits
  for its result.
* `check`: `ResilientLoop.run` with a `check_fn` (the loss and a host
  copy of the first layer's new weights finite, as a host check reads a
  step's result), `overlap_check=True` against False, on the `loop`
  part's model: overlapped, step n's check runs while step n+1 computes.
  `--check_ms`: the check also sleeps that long (a check that waits on
  something other than these cores, which a CPU device shares).
* `overhead`: the loop's own host cost: main-thread CPU time per step of
  `ResilientLoop.run` and of a bare loop of a trivial jitted step on a
  batch already on the device (`--steps` x 10 steps, `--rounds` rounds).
* `checkpoint`: a verified save and restore of a state of
  `--checkpoint_mib` MiB (two float32 leaves, replicated) with
  `recovery.Checkpoints` against plain Orbax `StandardCheckpointer`
  (`bench/recovery_suite.py`).

Prints one markdown table per part: ours, the reference (medians) and
their ratio (the loop: the median of each round's ratio, the two sides run
back to back).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

# bench/ is not installed: import it from this checkout.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
# pylint: disable=g-import-not-at-top,wrong-import-position

from bench import harness
import multihost
import recovery

# pylint: enable=g-import-not-at-top,wrong-import-position


def _median_ms(values: list[float]) -> float:
  return statistics.median(values) * 1e3


def _interleaved(sides: dict, rounds: int) -> dict[str, list[float]]:
  """Seconds per call of each side, `rounds` times; who goes first alternates."""
  names = list(sides)
  out: dict[str, list[float]] = {n: [] for n in names}
  for r in range(rounds):
    for name in (names if r % 2 == 0 else names[::-1]):
      t0 = time.perf_counter()
      sides[name]()
      out[name].append(time.perf_counter() - t0)
  return out


# -- the loop ------------------------------------------------------------------


def _mlp(width: int, layers: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {f'w{i}': (rng.standard_normal((width, width), np.float32) /
                    np.sqrt(width)).astype(np.float32)
          for i in range(layers)}


def _adam_step(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
  """A jitted Adam step of an MLP regression: (state, batch) -> (state, loss)."""

  def loss_fn(params, x, y):
    h = x
    names = sorted(params)
    for name in names[:-1]:
      h = jnp.tanh(h @ params[name])
    return jnp.mean((h @ params[names[-1]] - y) ** 2)

  @jax.jit
  def step(state, batch):
    params, m, v, t = state['params'], state['m'], state['v'], state['t']
    loss, g = jax.value_and_grad(loss_fn)(params, *batch)
    t = t + 1
    m = jax.tree.map(lambda a, b: b1 * a + (1 - b1) * b, m, g)
    v = jax.tree.map(lambda a, b: b2 * a + (1 - b2) * b * b, v, g)
    mh = jax.tree.map(lambda a: a / (1 - b1 ** t), m)
    vh = jax.tree.map(lambda a: a / (1 - b2 ** t), v)
    params = jax.tree.map(lambda p, a, b: p - lr * a / (jnp.sqrt(b) + eps),
                          params, mh, vh)
    return {'params': params, 'm': m, 'v': v, 't': t}, loss

  return step


def _loop_parts(width: int, layers: int, batch: int, samples: int):
  """The loop part's jitted step, `data_fn`, sampler and initial state."""
  mesh = jax.make_mesh((jax.device_count(),), ('data',))
  rep = jax.sharding.NamedSharding(mesh, jax.P())
  data_sharding = jax.sharding.NamedSharding(mesh, jax.P('data'))
  rng = np.random.default_rng(1)
  data = rng.standard_normal((samples, width), np.float32)
  targets = rng.standard_normal((samples, width), np.float32)

  def data_fn(ids):
    return (jax.device_put(data[ids], data_sharding),
            jax.device_put(targets[ids], data_sharding))

  params = _mlp(width, layers)
  user = jax.device_put({
      'params': params,
      'm': jax.tree.map(np.zeros_like, params),
      'v': jax.tree.map(np.zeros_like, params),
      't': np.float32(0)}, rep)
  step = _adam_step()
  sampler = recovery.EpochSampler(samples, batch)
  loop = recovery.ResilientLoop(step, data_fn=data_fn, sampler=sampler)
  return step, data_fn, sampler, loop.init(user, jax.random.key(0))


def loop_rows(*, width: int, layers: int, batch: int, samples: int,
              steps: int, rounds: int) -> list[str]:
  step, data_fn, sampler, start = _loop_parts(width, layers, batch, samples)
  loop = recovery.ResilientLoop(step, data_fn=data_fn, sampler=sampler)
  # The bare loop's ids: the ones the resilient loop draws, in order.
  ids, s = [], start
  for _ in range(steps):
    i, s = sampler.next(s)
    ids.append(i)
  # Compile and warm both (one full round each, untimed).
  last = {}

  def ours():
    result = loop.run(start, until_step=steps, progress_every_s=1e9)
    last['ours'] = result.last_loss

  def bare():
    state = start.user
    loss = None
    for i in ids:
      state, loss = step(state, data_fn(i))
    jax.block_until_ready((state, loss))
    last['bare'] = float(loss)

  ours()
  bare()
  if last['ours'] != last['bare']:
    raise AssertionError(f'The loops differ: last loss {last["ours"]} '
                         f'against {last["bare"]}.')
  times = _interleaved({'ours': ours, 'bare': bare}, rounds)
  o = _median_ms(times['ours']) / steps
  b = _median_ms(times['bare']) / steps
  # Each round's pair ran back to back (the same load): their ratio.
  ratios = sorted(a / c for a, c in zip(times['ours'], times['bare'],
                                        strict=True))
  return [f'| {layers}-layer MLP, width {width}, batch {batch}, {steps} steps '
          f'| {o:.3f} | {b:.3f} | {statistics.median(ratios):.3f} '
          f'| {ratios[0]:.3f}-{ratios[-1]:.3f} |']


def _finite(old, new, ids, loss, *, sleep_s: float = 0.0) -> None:
  """A host check of a step: its loss and the first layer's new weights are finite."""
  del old
  time.sleep(sleep_s)
  if not (np.isfinite(loss) and np.isfinite(np.asarray(
      new['params']['w0'])).all()):
    raise AssertionError(f'not finite after the batch of ids {ids[:4]}...')


def check_rows(*, width: int, layers: int, batch: int, samples: int,
               steps: int, rounds: int, check_ms: float) -> list[str]:
  step, data_fn, sampler, start = _loop_parts(width, layers, batch, samples)
  check = functools.partial(_finite, sleep_s=check_ms / 1e3)
  loops = {on: recovery.ResilientLoop(step, data_fn=data_fn, sampler=sampler,
                                      check_fn=check, overlap_check=on)
           for on in (True, False)}
  sides = {on: (lambda loop=loop: loop.run(start, until_step=steps,
                                           progress_every_s=1e9))
           for on, loop in loops.items()}
  for side in sides.values():  # Compile and warm (untimed).
    side()
  times = _interleaved(sides, rounds)
  on, off = (_median_ms(times[k]) / steps for k in (True, False))
  ratios = sorted(a / c for a, c in zip(times[True], times[False],
                                        strict=True))
  return [f'| {layers}-layer MLP, width {width}, batch {batch}, {steps} steps, '
          f'check + {check_ms:g} ms | {on:.3f} | {off:.3f} | {statistics.median(ratios):.3f} '
          f'| {ratios[0]:.3f}-{ratios[-1]:.3f} |']


def overhead_rows(*, steps: int, rounds: int) -> list[str]:
  x = jax.device_put(np.ones((8,), np.float32))
  step = jax.jit(lambda s, b: (s + b, jnp.sum(s)))
  loop = recovery.ResilientLoop(
      step, data_fn=lambda ids: x,
      sampler=recovery.EpochSampler(2 * steps, 2))
  start = loop.init(x, jax.random.key(0))

  def bare():
    state = start.user
    for _ in range(steps):
      state, _ = step(state, x)
    jax.block_until_ready(state)

  sides = {'ours': lambda: loop.run(start, until_step=steps,
                                    progress_every_s=1e9),
           'bare': bare}
  cpu: dict[str, list[float]] = {n: [] for n in sides}
  for f in sides.values():
    f()  # Warm.
  for r in range(rounds):
    for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
      t0 = time.thread_time()
      sides[name]()
      cpu[name].append((time.thread_time() - t0) / steps * 1e6)
  o, b = statistics.median(cpu['ours']), statistics.median(cpu['bare'])
  return [f'| trivial step, {steps} steps | {o:.1f} | {b:.1f} | {o - b:.1f} |']


# -- the conversions -----------------------------------------------------------


def convert_rows(sizes: list[int], repeats: int) -> list[str]:
  mesh = jax.make_mesh((jax.device_count(),), ('data',))
  spec = jax.P('data')
  rows = []
  cols = 1024
  for nbytes in sizes:
    n = max(jax.device_count(), nbytes // 4 // cols // jax.device_count()
            * jax.device_count())
    x = np.random.default_rng(2).random((n, cols), dtype=np.float32)
    label = harness.format_size(x.nbytes)

    def to_global(module, x=x):
      return jax.block_until_ready(
          module.host_local_array_to_global_array(x, mesh, spec))

    g = to_global(multihost_utils)
    mine = to_global(multihost)
    if not (mine.shape == g.shape and mine.sharding.is_equivalent_to(
        g.sharding, g.ndim) and np.array_equal(np.asarray(mine),
                                               np.asarray(g))):
      raise AssertionError(f'{label}: the global arrays differ.')

    def to_local(module, g=g):
      return jax.block_until_ready(
          module.global_array_to_host_local_array(g, mesh, spec))

    for what, fn in (('host_local_array_to_global_array', to_global),
                     ('global_array_to_host_local_array', to_local)):
      for _ in range(2):  # Warm.
        fn(multihost)
        fn(multihost_utils)
      times = _interleaved({'ours': lambda f=fn: f(multihost),
                            'jax': lambda f=fn: f(multihost_utils)}, repeats)
      o, j = _median_ms(times['ours']), _median_ms(times['jax'])
      rows.append(f'| {what} | {label} | {o:.3f} | {j:.3f} | {o / j:.2f} |')
  return rows


# -- a checkpoint --------------------------------------------------------------


def checkpoint_rows(mib: int, repeats: int) -> list[str]:
  from bench import recovery_suite  # pylint: disable=g-import-not-at-top
  width = mib * 2**20 // 8  # Two float32 leaves.
  rows = recovery_suite.recovery_rows(width, repeats, False, '',
                                      harness.Settings())
  return [f'| {r.op.removeprefix("recovery: ")} | {r.payload} '
          f'| {r.ours_ms:.0f} | {r.jax_ms:.0f} | {r.ratio:.2f} |'
          for r in rows]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--parts', default='loop,convert,checkpoint')
  parser.add_argument('--width', type=int, nargs='+', default=[256],
                      help='loop: MLP widths (one row each)')
  parser.add_argument('--layers', type=int, default=4)
  parser.add_argument('--batch', type=int, default=128)
  parser.add_argument('--steps', type=int, default=50)
  parser.add_argument('--rounds', type=int, default=41,
                      help='loop: interleaved rounds of each')
  parser.add_argument('--check_ms', type=float, default=0.0,
                      help='check: milliseconds each check also sleeps')
  parser.add_argument('--sizes', default='1,16,64',
                      help='convert: batch sizes in MiB')
  parser.add_argument('--repeats', type=int, default=21,
                      help='convert: interleaved calls of each')
  parser.add_argument('--checkpoint_mib', type=int, default=1024)
  parser.add_argument('--checkpoint_repeats', type=int, default=3)
  args = parser.parse_args()
  parts = args.parts.split(',')
  devices = jax.devices()
  print(f'{jax.process_count()} process, {len(devices)} '
        f'{devices[0].device_kind} device(s), jax {jax.__version__}, '
        f'{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}', flush=True)
  if 'loop' in parts:
    print('\n| loop | ResilientLoop.run ms/step | bare loop ms/step '
          '| ratio (median of rounds) | ratio by round |\n|---|---|---|---|---|')
    for width in args.width:
      for row in loop_rows(width=width, layers=args.layers,
                           batch=args.batch, samples=args.steps * args.batch,
                           steps=args.steps, rounds=args.rounds):
        print(row, flush=True)
  if 'check' in parts:
    print('\n| loop with a check_fn | overlap_check=True ms/step '
          '| overlap_check=False ms/step | ratio (median of rounds) '
          '| ratio by round |\n|---|---|---|---|---|')
    for width in args.width:
      for row in check_rows(width=width, layers=args.layers,
                            batch=args.batch, samples=args.steps * args.batch,
                            steps=args.steps, rounds=args.rounds,
                            check_ms=args.check_ms):
        print(row, flush=True)
  if 'overhead' in parts:
    print('\n| loop | ResilientLoop.run us/step | bare loop us/step '
          '| difference |\n|---|---|---|---|')
    for row in overhead_rows(steps=args.steps * 10, rounds=args.rounds):
      print(row, flush=True)
  if 'convert' in parts:
    print('\n| conversion | batch | ours ms | JAX ms | ratio |'
          '\n|---|---|---|---|---|')
    for row in convert_rows([int(s) << 20 for s in args.sizes.split(',')],
                            args.repeats):
      print(row, flush=True)
  if 'checkpoint' in parts:
    print('\n| checkpoint | state | recovery.Checkpoints ms '
          '| Orbax StandardCheckpointer ms | ratio |\n|---|---|---|---|---|')
    for row in checkpoint_rows(args.checkpoint_mib, args.checkpoint_repeats):
      print(row, flush=True)


if __name__ == '__main__':
  main()
