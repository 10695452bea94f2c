"""Data plane: device collectives over bytes, one packed transfer per call (MULTIHOST_TRANSPORT=device).

Payloads too large for the coordination service move here, as one uint8
buffer per process, over a 1-D mesh with one device per process (the
lowest-id device of each). Buffer lengths are rounded up to a few sizes so
that a handful of compiled programs serve every call.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from multihost._src.liveness import blocking
from multihost._src.runtime import leaves
from multihost._src.transport.tcp import pairs

_AXIS = 'processes'


@functools.cache
def _mesh() -> jax.sharding.Mesh:
  by_process: dict[int, jax.Device] = {}
  for d in jax.devices():
    best = by_process.get(d.process_index)
    if best is None or d.id < best.id:
      by_process[d.process_index] = d
  devices = [by_process[p] for p in range(jax.process_count())]
  return jax.sharding.Mesh(np.array(devices), (_AXIS,))


def _my_device() -> jax.Device:
  return _mesh().devices[jax.process_index()]


def bucket(n: int) -> int:
  """Rounds n up so that at most ~12% is padding and sizes repeat.

  The result is a multiple of 4096, so the buffer is also whole 32-bit words.
  """
  if n <= 4096:
    return 4096
  step = 1 << max(12, (n - 1).bit_length() - 3)
  return -(-n // step) * step


def _row(buffer: np.ndarray, length: int) -> jax.Array:
  """This process's (1, length) row of a (P, length) global array."""
  mesh = _mesh()
  if buffer.size == length:
    row = buffer.reshape(1, length)
  else:
    row = np.zeros((1, length), np.uint8)
    row[0, :buffer.size] = buffer
  # As 32-bit words: a quarter of the elements to move and add.
  local = jax.device_put(row.view(np.uint32), _my_device())
  sharding = jax.sharding.NamedSharding(mesh, jax.P(_AXIS))
  return jax.make_array_from_single_device_arrays(
      (mesh.size, length // 4), sharding, [local])


@functools.cache
def _gather_fn():
  replicated = jax.sharding.NamedSharding(_mesh(), jax.P())
  return jax.jit(lambda x: x, out_shardings=replicated)


@functools.cache
def _sum_fn():
  mesh = _mesh()
  body = jax.shard_map(lambda x: jax.lax.psum(x, _AXIS), mesh=mesh,
                       in_specs=jax.P(_AXIS), out_specs=jax.P())
  return jax.jit(body)


def _run(fn, row: jax.Array) -> np.ndarray:
  return np.asarray(fn(row).addressable_data(0)).view(np.uint8)


def allgather(buffer: np.ndarray, length: int, *, op: str,
              timeout: float) -> np.ndarray:
  """Gathers every process's uint8 buffer; returns a (P, >=length) array.

  Collective: every process must call this, in the same order, with the
  same `length` (>= every buffer's size).
  """
  row = _row(buffer, bucket(length))
  return blocking.call(op, _run, _gather_fn(), row, timeout=timeout)


def broadcast(buffer: np.ndarray | None, length: int, *, op: str,
              timeout: float) -> np.ndarray:
  """Returns the source's `length` bytes on every process.

  Collective: every process must call this, in the same order, with the
  same `length`; exactly one process passes a buffer (the others None).
  Memory per process is about two buffers, whatever the process count:
  it is a sum in which every process but the source adds zeros.
  """
  source = np.zeros(0, np.uint8) if buffer is None else buffer
  row = _row(source, bucket(length))
  out = blocking.call(op, _run, _sum_fn(), row, timeout=timeout)
  return out.reshape(-1)[:length]


class DeviceTransport:
  """The `Transport` over JAX device collectives (NCCL, ICI; gloo on CPU)."""

  name = 'device'

  def broadcast(self, parts: list[np.ndarray] | None, length: int,
                source: int, *, op: str, timeout: float,
                source_result: bool = True,
                early: object | None = None,
                relay: object | None = None) -> np.ndarray | None:
    """See `Transport.broadcast` (a sum in which only the source adds bytes)."""
    del source, early, relay  # Every process but the source adds zeros.
    packed = None if parts is None else leaves.pack(parts)
    out = broadcast(packed, length, op=op, timeout=timeout)
    return out if parts is None or source_result else None

  def allgather(self, buffer: np.ndarray, sizes: list[int], *, op: str,
                timeout: float) -> np.ndarray:
    """See `Transport.allgather`."""
    return allgather(buffer, max(sizes), op=op, timeout=timeout)

  def exchange(self, sends: dict[int, list], incoming: dict[int, int], *,
               op: str, timeout: float) -> dict[int, np.ndarray]:
    """See `Transport.exchange`: over the TCP links (a device collective cannot send to one process only)."""
    return pairs.exchange(sends, incoming, op=op, timeout=timeout)


DEVICE = DeviceTransport()
