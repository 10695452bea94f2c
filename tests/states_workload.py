"""Training states real code carries, trained, saved, stopped and resumed.

Used in-process by tests/unit/test_states.py (one controller) and run as a script
by it in several controllers:

  python tests/states_workload.py fresh OUT.json DIR   # reference, stop, resume
  python tests/states_workload.py resume OUT.json DIR  # resume DIR/<kind>

Kinds (`KINDS`):
  optax  adam with a schedule, adamw with a schedule, and a chain with
         gradient clipping; params sharded on a mesh of every device;
         `opt.init` outside jit (its counts are uncommitted scalars).
  linen  a flax.linen MLP in flax.training.train_state.TrainState (step: a
         Python int at first), on the default device (uncommitted).
  nnx    the graphdef and state of `nnx.split` of a model and an
         nnx.Optimizer, on the default device.
  mixed  Python int/float/bool, NumPy arrays and scalars, None, empty
         subtrees, a namedtuple, a flax struct dataclass with a static field,
         typed PRNG keys.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import multihost
import recovery

KINDS = ('optax', 'linen', 'nnx', 'mixed')
# 4 steps an epoch: the stop (a save) falls mid-epoch, so the resumed steps
# read their batches from the restored order at the restored cursor.
SAVE_EVERY = 3
STOP_AT = 6
UNTIL = 8
NUM_SAMPLES, BATCH, DIM = 32, 8, 8

_X = np.random.RandomState(0).randn(NUM_SAMPLES, DIM).astype(np.float32)
_Y = (_X @ np.linspace(-1, 1, DIM, dtype=np.float32))[:, None]


def _local_batch(ids):
  return {'x': _X[ids], 'y': _Y[ids]}


def _optax_loop():
  import optax  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((jax.device_count(),), ('d',))
  rows = jax.NamedSharding(mesh, jax.P('d', None))
  rep = jax.NamedSharding(mesh, jax.P())
  params = {'w': jax.device_put(np.zeros((DIM, 1), np.float32), rows),
            'b': jax.device_put(np.zeros((1,), np.float32), rep)}
  opts = {
      'adam': optax.adam(optax.exponential_decay(0.05, 2, 0.9)),
      'adamw': optax.adamw(optax.warmup_cosine_decay_schedule(
          0.0, 0.05, 2, 20), weight_decay=1e-2),
      'chain': optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.05)),
  }
  user = {name: (params, opt.init(params)) for name, opt in opts.items()}

  def loss_fn(p, batch):
    return jnp.mean((batch['x'] @ p['w'] + p['b'] - batch['y']) ** 2)

  @jax.jit
  def step(state, batch):
    out, total = {}, 0.0
    for name, opt in opts.items():
      p, o = state[name]
      loss, g = jax.value_and_grad(loss_fn)(p, batch)
      u, o = opt.update(g, o, p)
      out[name] = (optax.apply_updates(p, u), o)
      total += loss
    return out, total

  def data_fn(ids):
    return jax.device_put(_local_batch(ids), rep)
  return step, data_fn, user


def _linen_loop():
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(1)(nn.tanh(nn.Dense(16)(x)))

  model = MLP()
  params = model.init(jax.random.key(1), _X[:1])
  user = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                       tx=optax.adam(0.02))

  @jax.jit
  def step(state, batch):
    def loss_fn(p):
      return jnp.mean((state.apply_fn(p, batch['x']) - batch['y']) ** 2)
    loss, g = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=g), loss
  return step, _local_batch, user


def _nnx_loop():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.hidden = nnx.Linear(DIM, 16, rngs=rngs)
      self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
      return self.out(nnx.tanh(self.hidden(x)))

  model = MLP(nnx.Rngs(2))
  opt = nnx.Optimizer(model, optax.adamw(0.02), wrt=nnx.Param)
  graphdef, state = nnx.split((model, opt))

  @jax.jit
  def step(user, batch):
    model, opt = nnx.merge(*user)
    def loss_fn(m):
      return jnp.mean((m(batch['x']) - batch['y']) ** 2)
    loss, g = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, g)
    return nnx.split((model, opt)), loss
  return step, _local_batch, (graphdef, state)


Extra = collections.namedtuple('Extra', ['seen', 'note'])


def _mixed_loop():
  from flax import struct  # pylint: disable=g-import-not-at-top

  @struct.dataclass
  class Stats:
    total: Any
    label: str = struct.field(pytree_node=False, default='stats')

  user = {
      'w': jnp.zeros((DIM, 1)),  # uncommitted
      'count': 0, 'lr': 0.1, 'flag': False,
      'hist': np.zeros(3, np.float64), 'scale': np.float32(1.0),
      'nothing': None, 'empty': {}, 'unit': (),
      'extra': Extra(seen=np.int64(0), note=None),
      'stats': Stats(total=0.0),
      'rng': jax.random.key(3),
      'keys': jax.random.split(jax.random.key(4, impl='rbg'), 2),
  }

  @jax.jit
  def inner(w, rng, keys, lr, batch):
    rng, sub = jax.random.split(rng)
    noise = 1e-3 * jax.random.normal(sub, w.shape)
    keys = jax.vmap(lambda k: jax.random.split(k)[0])(keys)
    def loss_fn(w):
      return jnp.mean((batch['x'] @ w - batch['y']) ** 2)
    loss, g = jax.value_and_grad(loss_fn)(w)
    return w - lr * g + noise, rng, keys, loss

  def step(state, batch):
    w, rng, keys, loss = inner(state['w'], state['rng'], state['keys'],
                               state['lr'], batch)
    loss_host = float(loss)
    new = dict(state, w=w, rng=rng, keys=keys, count=state['count'] + 1,
               lr=state['lr'] * 0.95, flag=not state['flag'],
               hist=np.concatenate([state['hist'][1:], [loss_host]]),
               scale=np.float32(state['scale'] * 0.5),
               extra=state['extra']._replace(seen=state['extra'].seen + 1),
               stats=state['stats'].replace(
                   total=state['stats'].total + loss_host))
    return new, loss
  return step, _local_batch, user


BUILDERS = {'optax': _optax_loop, 'linen': _linen_loop, 'nnx': _nnx_loop,
            'mixed': _mixed_loop}


def build(kind: str):
  """(loop, fresh initial state) of `kind`, built on the current devices."""
  step, data_fn, user = BUILDERS[kind]()
  loop = recovery.ResilientLoop(
      step, data_fn=data_fn,
      sampler=recovery.EpochSampler(NUM_SAMPLES, BATCH))
  return loop, loop.init(user, jax.random.key(0))


def describe(x) -> tuple:
  """What the promise keeps of a leaf: type, dtype, shape, placement."""
  if isinstance(x, jax.Array):
    return (type(x).__name__, str(x.dtype), x.shape, x.committed,
            x.is_fully_addressable, repr(x.sharding))
  return (type(x).__name__, str(getattr(x, 'dtype', '')), np.shape(x))


def check_like(target, restored) -> None:
  """Raises unless `restored` has `target`'s treedef and leaf kinds."""
  assert (jax.tree.structure(target) == jax.tree.structure(restored)), (
      jax.tree.structure(target), jax.tree.structure(restored))
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(target)[0],
                          jax.tree.leaves(restored), strict=True):
    assert describe(a) == describe(b), (jax.tree_util.keystr(path),
                                        describe(a), describe(b))


def train(kind: str, directory: str | None, *, until: int, resume: bool,
          built=None) -> dict[int, float]:
  """Trains `kind` to step `until` in `directory`; returns {step: loss}.

  With `resume`, restores the latest checkpoint onto a fresh target and
  checks that every restored leaf is of the target's kind. Without a
  `directory` (a reference run), trains from the fresh state and saves
  nothing: a save does not change the losses, and each costs a write.
  """
  loop, initial = built or build(kind)
  losses = {}
  if directory is None:
    assert not resume, 'a run without a folder has nothing to resume'
    loop.run(initial, until_step=until,
             on_step=lambda s, rec: losses.__setitem__(rec.step, rec.loss))
    return losses
  with recovery.Checkpoints(directory, save_every=SAVE_EVERY,
                            keep=3) as ckpt:
    state = ckpt.start(initial, resume=resume)
    if resume:
      check_like(initial.user, state.user)
    loop.run(state, until_step=until, checkpoints=ckpt,
             on_step=lambda s, rec: losses.__setitem__(rec.step, rec.loss))
  return losses


def raw_tree_checks(user) -> dict[str, bool]:
  """Whether multihost's own digest and check take the raw state as equal.

  Collective: every process must call this, in the same order.
  """
  digest = np.frombuffer(bytes.fromhex(multihost.tree_digest(user)), np.uint8)
  everyone = multihost.process_allgather(digest)
  try:
    multihost.assert_equal(user, 'raw state')
    equal = True
  except multihost.ConsistencyError:
    equal = False
  return {'tree_digest': bool((everyone == everyone[0]).all()),
          'assert_equal': equal}


def main(argv: list[str]) -> None:
  mode, out, directory = argv[1:4]
  kinds = argv[4].split(',') if len(argv) > 4 else KINDS
  multihost.initialize()
  recovery.quiet_orbax_logs()
  result = {}
  for kind in kinds:
    built = build(kind)
    if mode == 'fresh':
      ref = train(kind, None, until=UNTIL, resume=False, built=built)
      run = f'{directory}/run/{kind}'
      first = train(kind, run, until=STOP_AT, resume=False, built=built)
      if jax.process_index() == 0:
        shutil.copytree(run, f'{directory}/saved/{kind}')
      multihost.sync_global_devices(f'copied {kind}')
      resumed = train(kind, run, until=UNTIL, resume=True, built=build(kind))
      result[kind] = {'ref': ref, 'first': first, 'resumed': resumed,
                      'raw': raw_tree_checks(built[1].user)}
    else:
      result[kind] = {'resumed': train(kind, f'{directory}/{kind}',
                                       until=UNTIL, resume=True, built=built)}
  if jax.process_index() == 0:
    with open(out + '.tmp', 'w') as f:
      json.dump(result, f)
    os.replace(out + '.tmp', out)
  print(f'[process={jax.process_index()}] workload {mode} done', flush=True)


if __name__ == '__main__':
  main(sys.argv)
