"""Data plane: the `MULTIHOST_TRANSPORT` switch (TCP, the default, or a device collective); a timeout says where the late peers are."""

from __future__ import annotations

import os

import numpy as np

from multihost import _control_links
from multihost import _data_device
from multihost import _data_tcp
from multihost import _errors
from multihost import _runtime
from multihost import _where
from multihost import env as _env


def tcp_enabled() -> bool:
  """Whether large payloads travel over TCP (else over a device collective)."""
  value = os.environ.get(_env.TRANSPORT, 'tcp').lower()
  if value not in ('tcp', 'device'):
    raise ValueError(
        f'${_env.TRANSPORT}={value!r} is not a transport; use tcp (the '
        'default) or device.')
  return value == 'tcp'


def carries_small_payloads() -> bool:
  """Whether small payloads of arrays travel here rather than in the headers.

  Over TCP, once the agreement barrier has passed, a small payload takes one
  hop per process on an open connection, where the key-value store takes
  one or two more RPCs. A device
  collective is slower than those RPCs, so with it small payloads stay in
  the headers. Once calls agree over the TCP links (`_control_links`), the
  headers travel there, so small payloads ride along: no second phase.
  """
  return tcp_enabled() and not _control_links.usable(_runtime.current())


def broadcast(buffer: np.ndarray | None, length: int, source: int, *,
              op: str, timeout: float) -> np.ndarray:
  """The source's `length` bytes, on every process.

  Collective: every process must call this, in the same order, with the
  same `length` and `source`; only the source passes a buffer.
  """
  try:
    if tcp_enabled():
      return _data_tcp.broadcast(buffer, length, source, op=op,
                                 timeout=timeout)
    return _data_device.broadcast(buffer, length, op=op, timeout=timeout)
  except _errors.CollectiveTimeoutError as e:
    raise _where.with_whereabouts(e) from e


def allgather(buffer: np.ndarray, sizes: list[int], *, op: str,
              timeout: float) -> np.ndarray:
  """Every process's bytes, as rows: process p's are rows[p, :sizes[p]].

  Collective: every process must call this, in the same order, with the
  same `sizes`.
  """
  try:
    if tcp_enabled():
      return _data_tcp.allgather(buffer, sizes, op=op, timeout=timeout)
    return _data_device.allgather(buffer, max(sizes), op=op, timeout=timeout)
  except _errors.CollectiveTimeoutError as e:
    raise _where.with_whereabouts(e) from e
