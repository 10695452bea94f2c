"""bin/train.py's model: the tutorial's linear regression, its jitted step, and the step's check against the host (a module of that binary, not one itself).

`python bin/train.py` puts bin/ first on sys.path, so train.py imports
this module as `_train_model`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import recovery

BASE_LR = 0.04
MOMENTUM = 0.8


def learning_rate(width: int, batch_size: int) -> float:
  """The tutorial's 0.04, scaled down so that momentum SGD stays stable.

  The largest curvature of the batch loss grows like (1 + sqrt(width /
  batch))^2 for Gaussian data; the tutorial's size (width == batch) gets 0.04.
  """
  return BASE_LR * min(1.0, 4.0 / (1.0 + math.sqrt(width / batch_size))**2)


class LinearRegression:
  """The tutorial's fixture: data, targets, jitted step and its host check."""

  def __init__(self, mesh: jax.sharding.Mesh, *, width: int, samples: int,
               batch_size: int, shard_params: bool = False):
    P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
    self.rep = jax.sharding.NamedSharding(mesh, P())
    # Sharded parameters: each device holds width / devices of them.
    self.params = (jax.sharding.NamedSharding(mesh, P('data')) if shard_params
                   else self.rep)
    self.row = jax.sharding.NamedSharding(mesh, P('data', None))
    self.label = jax.sharding.NamedSharding(mesh, P('data'))
    self.width, self.batch_size = width, batch_size
    # Identical synthetic fixture on every controller.
    self.data = np.random.default_rng(41).normal(
        size=(samples, width)).astype(np.float32)
    self.truth = np.linspace(-0.3, 0.4, width, dtype=np.float32)
    self.targets = self.data @ self.truth
    self.lr = learning_rate(width, batch_size)
    lr = self.lr

    params = {'weights': self.params, 'momentum': self.params}

    @functools.partial(jax.jit, out_shardings=(params, self.rep))
    def update(user, batch):
      x, y = batch
      w, velocity = user['weights'], user['momentum']
      loss, grad = jax.value_and_grad(lambda a: jnp.mean((x @ a - y)**2))(w)
      v = MOMENTUM * velocity + grad
      return {'weights': w - lr * v, 'momentum': v}, loss

    self.update = update

  def placed(self, value: np.ndarray, sharding) -> jax.Array:
    a = np.asarray(value)
    return jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])

  def initial_user_state(self) -> dict[str, jax.Array]:
    zeros = np.zeros(self.width, np.float32)
    return {'weights': self.placed(zeros, self.params),
            'momentum': self.placed(zeros, self.params)}

  def batch(self, ids: np.ndarray):
    return (self.placed(self.data[ids], self.row),
            self.placed(self.targets[ids], self.label))

  def check(self, old_user, new_user, ids, loss) -> None:
    """Checks one step against an independent host-side computation.

    The host recomputes the gradient in float64 from the same data. The
    tolerance is the tutorial's (rtol 2e-5, atol 2e-6) plus the rounding
    bound of the device's float32 sums, which grows with the width; at the
    tutorial's sizes that bound is negligible.
    """
    old, new = recovery.host_tree(old_user), recovery.host_tree(new_user)
    x = self.data[ids].astype(np.float64)
    y = self.targets[ids].astype(np.float64)
    w_old = old['weights'].astype(np.float64)
    residual = x @ w_old - y
    g = 2 * x.T @ residual / self.batch_size
    eps = float(np.finfo(np.float32).eps)
    scale = 2 / self.batch_size * np.abs(x).T @ (np.abs(x) @ np.abs(w_old)
                                                 + np.abs(y))
    rounding = 4 * eps * math.sqrt(self.width + self.batch_size) * scale
    _close('loss', np.float64(loss), np.mean(residual**2),
           4 * eps * np.mean((np.abs(x) @ np.abs(w_old) + np.abs(y))**2))
    _close('momentum', new['momentum'],
           MOMENTUM * old['momentum'].astype(np.float64) + g, rounding)
    _close('weights', new['weights'],
           w_old - self.lr * new['momentum'].astype(np.float64), 0.0)


def _close(name: str, actual, desired, slack) -> None:
  """Raises AssertionError unless |actual - desired| <= tolerance + slack."""
  actual = np.asarray(actual, np.float64)
  err = np.abs(actual - desired)
  tol = recovery.ATOL + recovery.RTOL * np.abs(desired) + slack
  if not np.all(err <= tol):
    i = np.unravel_index(np.argmax(err - tol), np.shape(err))
    raise AssertionError(
        f'{name} differs from the host check at index {tuple(map(int, i))}: '
        f'device {np.asarray(actual)[i]!r}, host {np.asarray(desired)[i]!r}, '
        f'tolerance {np.broadcast_to(tol, np.shape(err))[i]:.3g} (rtol='
        f'{recovery.RTOL}, atol={recovery.ATOL} plus float32 rounding).')
