"""Moves large payloads: over TCP (default) or a device collective."""

from __future__ import annotations

import numpy as np

from multihost import _device
from multihost import _transport


def broadcast(buffer: np.ndarray | None, length: int, source: int, *,
              op: str, timeout: float) -> np.ndarray:
  """The source's `length` bytes, on every process.

  Collective: every process must call this, in the same order, with the
  same `length` and `source`; only the source passes a buffer.
  """
  if _transport.enabled():
    return _transport.broadcast(buffer, length, source, op=op,
                                timeout=timeout)
  return _device.broadcast(buffer, length, op=op, timeout=timeout)


def allgather(buffer: np.ndarray, sizes: list[int], *, op: str,
              timeout: float) -> np.ndarray:
  """Every process's bytes, as rows: process p's are rows[p, :sizes[p]].

  Collective: every process must call this, in the same order, with the
  same `sizes`.
  """
  if _transport.enabled():
    return _transport.allgather(buffer, sizes, op=op, timeout=timeout)
  return _device.allgather(buffer, max(sizes), op=op, timeout=timeout)
