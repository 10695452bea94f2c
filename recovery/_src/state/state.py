"""The complete transition state of a training run, and the epoch sampler."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

PyTree = Any


@dataclasses.dataclass(frozen=True)
class TransitionState:
  """Everything a run needs to take its next step exactly as it would have.

  Attributes:
    user: the user's state pytree (params, optimizer state, ...), usually
      `jax.Array`s placed on the current mesh.
    key: a typed PRNG key (`jax.random.key`); the sampler splits it at every
      epoch boundary to draw the next permutation.
    order: int32 [num_samples], the current epoch's permutation of sample ids.
    cursor: position of the next batch in `order`.
    epoch: number of completed reshuffles (0 during the first epoch).
    step: number of steps taken so far.
  """
  user: PyTree
  key: jax.Array
  order: np.ndarray
  cursor: int
  epoch: int
  step: int

  def to_tree(self) -> dict[str, Any]:
    """The state as a checkpointable pytree (typed key stored as key_data)."""
    return {
        'user': self.user,
        'data': {
            'key': np.asarray(jax.random.key_data(self.key)),
            'order': np.asarray(self.order, np.int32),
            'cursor': np.asarray(self.cursor, np.int64),
            'epoch': np.asarray(self.epoch, np.int64),
            'step': np.asarray(self.step, np.int64),
        },
    }

  @classmethod
  def from_tree(cls, tree: dict[str, Any], *,
                key_like: jax.Array) -> TransitionState:
    """Inverse of `to_tree`; `key_like` supplies the PRNG implementation."""
    data = tree['data']
    # It takes any array (numpy's here); its annotation says Array.
    key = jax.random.wrap_key_data(
        np.asarray(data['key']),  # type: ignore[arg-type]
        impl=jax.random.key_impl(key_like))
    return cls(user=tree['user'], key=key,
               order=np.asarray(data['order'], np.int32),
               cursor=int(data['cursor']), epoch=int(data['epoch']),
               step=int(data['step']))

  def replace(self, **changes) -> TransitionState:
    """A copy with `changes` (as `dataclasses.replace`, without its `__init__`).

    Raises:
      TypeError: a change names no field.
    """
    if not changes.keys() <= _FIELDS:
      raise TypeError(f'TransitionState has no field(s) '
                      f'{sorted(changes.keys() - _FIELDS)}; its fields are '
                      f'{sorted(_FIELDS)}.')
    # The fields copied as they are (no __init__: a frozen dataclass's sets
    # each field through object.__setattr__, a third of this call's time).
    new = _new(type(self))
    fields = new.__dict__
    fields.update(self.__dict__)
    fields.update(changes)
    return new

  def _with(self, user: PyTree, key: jax.Array, order: np.ndarray,
            cursor: int, epoch: int, step: int) -> TransitionState:
    """A state of this type with these fields (`replace` without its checks, for `EpochSampler.next` and the loop's step)."""
    new = _new(type(self))
    new.__dict__.update(user=user, key=key, order=order, cursor=cursor,
                        epoch=epoch, step=step)
    return new


_new = object.__new__


_FIELDS = frozenset(f.name for f in dataclasses.fields(TransitionState))


class EpochSampler:
  """Draws batches of sample ids from a per-epoch permutation of the data.

  The permutation is a pure function of the carried key, so every controller
  draws the same ids, and a run restored from a checkpoint draws the same ids
  as the run that saved it. At an epoch boundary (fewer than `batch_size` ids
  left) the key is split and the next epoch's permutation drawn from it; a
  trailing partial batch is dropped.
  """

  def __init__(self, num_samples: int, batch_size: int):
    if not 0 < batch_size <= num_samples:
      raise ValueError(
          f'EpochSampler needs 0 < batch_size <= num_samples; got '
          f'batch_size={batch_size}, num_samples={num_samples}. Use more '
          'samples or a smaller batch.')
    self.num_samples = int(num_samples)
    self.batch_size = int(batch_size)

  def _permutation(self, key: jax.Array) -> np.ndarray:
    return np.asarray(jax.random.permutation(key, self.num_samples), np.int32)

  def start(self, key: jax.Array) -> tuple[jax.Array, np.ndarray]:
    """Returns (carried key, first epoch's order) drawn from `key`."""
    key, order_key = jax.random.split(key)
    return key, self._permutation(order_key)

  def next(self, state: TransitionState) -> tuple[np.ndarray, TransitionState]:
    """Returns the next batch's ids and the state with the cursor advanced.

    Does not change `state.step` or `state.user`.
    """
    ids, key, order, cursor, epoch = self._draw(state)
    return ids, state._with(state.user, key, order, cursor, epoch,  # pylint: disable=protected-access
                            state.step)

  def _draw(self, state: TransitionState
            ) -> tuple[np.ndarray, jax.Array, np.ndarray, int, int]:
    """`next`'s ids, then the fields it changes: key, order, cursor, epoch."""
    key, order = state.key, state.order
    cursor, epoch, size = state.cursor, state.epoch, self.batch_size
    if order.ndim != 1 or len(order) != self.num_samples:  # Shape (N,).
      raise ValueError(
          f'The carried data order has shape {order.shape}, but this sampler '
          f'draws from num_samples={self.num_samples}. The state was made for '
          'a different data set size (another EpochSampler num_samples).')
    if cursor + size > self.num_samples:
      key, shuffle_key = jax.random.split(key)
      order = self._permutation(shuffle_key)
      cursor, epoch = 0, epoch + 1
    # A copy: the caller may change its ids; the order stays as drawn.
    return (order[cursor:cursor + size].copy(), key, order, cursor + size,
            epoch)
