"""The recovery suite: `recovery.Checkpoints` save + restore against plain Orbax.

A transition state of two float32 leaves of `width` weights (replicated on
every device, as in bin/train.py, or sharded over all devices) is saved and
restored with `recovery.Checkpoints` (async save until committed, with its
agreement check and digests; restore with its digest and agreement checks)
and with plain `orbax.checkpoint.StandardCheckpointer`, alternating, one
untimed round of each first, on a folder shared by all processes.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from bench import harness
from bench.harness import Row
from bench.harness import Settings
from bench.harness import barrier
from bench.harness import ms
from bench.harness import slowest
from bench.harness import slowest_one
import multihost
import recovery


def recovery_rows(width: int, repeats: int, sharded: bool, parent: str,
                  settings: Settings) -> list[Row]:
  """Three rows: save, restore, and both. Collective: every process calls it.

  Args:
    width: float32 weights per leaf; with `sharded`, a multiple of the
      device count.
    repeats: timed rounds of each (after one untimed round of each).
    sharded: shard the leaves over all devices instead of replicating them.
    parent: parent folder of the checkpoint folders, shared by all
      processes ('' for the temp folder).
    settings: the harness settings (timeout of the collectives).
  """
  mesh = jax.make_mesh((jax.device_count(),), ('data',))
  count = jax.device_count()
  if sharded and width % count:
    raise ValueError(f'width={width} must be a multiple of the device count '
                     f'({count}) to shard the state over all devices.')
  sharding = jax.sharding.NamedSharding(mesh,
                                        jax.P('data') if sharded else jax.P())

  state, target = _states(width, sharding)
  tree = state.to_tree()
  abstract = jax.tree.map(_abstract, tree)
  nbytes = sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
               for x in jax.tree.leaves(tree))
  leaves = len(jax.tree.leaves(tree))

  root = None
  if jax.process_index() == 0:
    root = tempfile.mkdtemp(prefix='multihost-bench-',
                            dir=parent or None)
  root = multihost.broadcast_object(root, timeout=settings.timeout)

  def ours(folder: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    checkpoints = recovery.Checkpoints(folder, save_every=1, keep=1,
                                       async_save=True)
    checkpoints.save(state, force=True)
    checkpoints.wait()
    t1 = time.perf_counter()
    restored = checkpoints.restore(target, step=state.step)
    jax.block_until_ready(restored.user)
    t2 = time.perf_counter()
    checkpoints.close()
    return t1 - t0, t2 - t1

  def plain(folder: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(folder, 'state'), tree)
    checkpointer.wait_until_finished()
    t1 = time.perf_counter()
    restored = checkpointer.restore(os.path.join(folder, 'state'), abstract)
    jax.block_until_ready(restored)
    t2 = time.perf_counter()
    checkpointer.close()
    return t1 - t0, t2 - t1

  results: dict[str, list[tuple[float, float]]] = {'ours': [], 'plain': []}
  firsts = {}
  try:
    for r in range(repeats + 1):
      for name, fn in (('ours', ours), ('plain', plain)):
        folder = os.path.join(root, f'{name}-{r}')
        barrier(settings)
        timing = fn(folder)
        barrier(settings)
        if jax.process_index() == 0:
          shutil.rmtree(folder, ignore_errors=True)
        if r == 0:
          firsts[name] = timing  # Untimed round: first call of each.
        else:
          results[name].append(timing)
  finally:
    barrier(settings)
    if jax.process_index() == 0:
      shutil.rmtree(root, ignore_errors=True)

  def summary(name: str, phase: int | None) -> tuple[float, float]:
    per_iter = [t[phase] if phase is not None else t[0] + t[1]
                for t in results[name]]
    first = (firsts[name][phase] if phase is not None
             else sum(firsts[name]))
    return (ms(statistics.median(slowest(per_iter, settings))),
            ms(slowest_one(first, settings)))

  rows = []
  label = (f'{nbytes / 2**20:.4g} MiB, {leaves} leaves, '
           f'{"sharded" if sharded else "replicated"}')
  for phase, what in ((0, 'save (async, until committed)'),
                      (1, 'restore (+ digest and agreement checks)'),
                      (None, 'save + restore + verification')):
    ours_ms, ours_first = summary('ours', phase)
    plain_ms, plain_first = summary('plain', phase)
    rows.append(Row(f'recovery: {what}', nbytes, leaves, kind='recovery',
                    ours_ms=ours_ms, jax_ms=plain_ms, ours_first_ms=ours_first,
                    jax_first_ms=plain_first, payload=label,
                    note='jax_ms: plain orbax StandardCheckpointer'))
  return rows


def _states(width: int, sharding: jax.sharding.Sharding
            ) -> tuple[recovery.TransitionState, recovery.TransitionState]:
  """A state of two `width`-float leaves placed by `sharding`, and a zeroed restore target."""

  def placed(a: np.ndarray) -> jax.Array:
    return jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])

  rng = np.random.default_rng(6)
  state = recovery.TransitionState(
      user={'weights': placed(rng.standard_normal(width, np.float32)),
            'momentum': placed(rng.standard_normal(width, np.float32))},
      key=jax.random.key(7), order=np.arange(64, dtype=np.int32), cursor=8,
      epoch=1, step=1)
  target = state.replace(
      user=jax.tree.map(lambda x: placed(np.zeros(x.shape, x.dtype)),
                        state.user), step=0)
  return state, target


def _abstract(x):
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return np.asarray(x)


def sharded_state_row(width: int, repeats: int, parent: str,
                      settings: Settings) -> Row:
  """One row: save + restore of a state sharded 4 ways, against plain Orbax.

  Collective: every process calls it. Needs a device count that is a
  multiple of 4: the leaves are sharded over a mesh axis of 4 (and
  replicated over the rest of the devices). Times as in `recovery_rows`;
  peak memory is the largest per-process increase of one more round of each
  (`harness.peak_increase`), which for ours includes computing the digests
  from each process's own shards.

  Args:
    width: float32 weights per leaf (two leaves); a multiple of 4.
    repeats: timed rounds of each (after one untimed round of each).
    parent: parent folder of the checkpoint folders, shared by all
      processes ('' for the temp folder).
    settings: the harness settings (timeout of the collectives).
  """
  count = jax.device_count()
  if count % 4 or width % 4:
    raise ValueError(f'A state sharded 4 ways needs a device count ({count}) '
                     f'and a width ({width}) that are multiples of 4.')
  mesh = jax.make_mesh((4, count // 4), ('shards', 'replicas'))
  sharding = jax.sharding.NamedSharding(mesh, jax.P('shards'))

  state, target = _states(width, sharding)
  tree = state.to_tree()
  abstract = jax.tree.map(_abstract, tree)
  nbytes = 2 * 4 * width
  root = None
  if jax.process_index() == 0:
    root = tempfile.mkdtemp(prefix='multihost-bench-', dir=parent or None)
  root = multihost.broadcast_object(root, timeout=settings.timeout)
  rounds = iter(range(1 << 30))

  def ours():
    folder = os.path.join(root, f'ours-{next(rounds)}')
    with recovery.Checkpoints(folder, save_every=1, keep=1,
                              async_save=False) as checkpoints:
      checkpoints.save(state, force=True)
      jax.block_until_ready(checkpoints.restore(target, step=state.step).user)

  def plain():
    folder = os.path.join(root, f'plain-{next(rounds)}', 'state')
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(folder, tree)
    checkpointer.wait_until_finished()
    jax.block_until_ready(checkpointer.restore(folder, abstract))
    checkpointer.close()

  times: dict[str, list[float]] = {'ours': [], 'plain': []}
  firsts, peaks = {}, {}
  try:
    for r in range(repeats + 1):
      for name, fn in (('ours', ours), ('plain', plain)):
        elapsed = harness.timed(fn, settings)
        if r:
          times[name].append(elapsed)
        else:
          firsts[name] = elapsed
    for name, fn in (('ours', ours), ('plain', plain)):
      peaks[name] = (slowest_one(harness.peak_increase(fn, settings),
                                 settings) if settings.memory else None)
  finally:
    barrier(settings)
    if jax.process_index() == 0:
      shutil.rmtree(root, ignore_errors=True)
  return Row('recovery: save + restore, state sharded 4 ways', nbytes, 2,
             kind='recovery',
             ours_ms=ms(statistics.median(slowest(times['ours'], settings))),
             jax_ms=ms(statistics.median(slowest(times['plain'], settings))),
             ours_first_ms=ms(slowest_one(firsts['ours'], settings)),
             jax_first_ms=ms(slowest_one(firsts['plain'], settings)),
             ours_peak_bytes=peaks['ours'], jax_peak_bytes=peaks['plain'],
             payload=f'{nbytes / 2**20:.4g} MiB, 2 leaves over 4 shards, '
             f'{jax.process_count()} processes',
             note='jax_ms: plain orbax StandardCheckpointer; peak: max '
             'per-process increase')
