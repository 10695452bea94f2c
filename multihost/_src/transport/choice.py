"""The choice of each payload's `Transport` (TCP or a device collective), by backend and size; a timeout says where the late peers are.

The rule (`choose_transport`):
* `MULTIHOST_TRANSPORT=tcp` or `device` forces one transport for every
  payload.
* Otherwise, on CPU every payload moves over TCP between the hosts: gloo's
  device collectives move bytes several times slower there (measured
  when the transports were chosen; no doc keeps that table now).
* On GPU and TPU, payloads of more than `DEVICE_BYTES` move with a device
  collective (NCCL, ICI), smaller ones over TCP (a device collective's
  launch costs more than a few TCP hops).
Every input of the rule (the override, the backend, the payload size) is
the same on every process once the agreement has passed, so every process
picks the same transport without exchanging anything.
"""

from __future__ import annotations

import functools
from typing import Literal
from typing import overload

import jax
import numpy as np

from multihost._src.diagnostics import where
from multihost._src.runtime import errors
from multihost._src.runtime import runtime
from multihost._src.runtime import settings
from multihost._src.transport import device
from multihost._src.transport import interface
from multihost._src.transport.tcp import chain
from multihost._src.transport.tcp import eager as _eager
from multihost._src.transport.tcp import link
from multihost._src.transport.tcp import shared
from multihost._src.transport.tcp import tree

# On GPU/TPU backends, payloads larger than this use a device collective.
DEVICE_BYTES = 1 << 20
_DEVICE_BACKENDS = ('gpu', 'cuda', 'rocm', 'tpu')


def choose_transport(backend: str, nbytes: int, *,
                     override: str | None = None) -> str:
  """'tcp' or 'device': how a payload of `nbytes` per process moves.

  Pure (the seam the tests use): `backend` is `jax.default_backend()`,
  `override` the validated `MULTIHOST_TRANSPORT` (None when unset). See the
  module docstring for the rule.
  """
  if override is not None:
    return override
  if backend.lower() in _DEVICE_BACKENDS and nbytes > DEVICE_BYTES:
    return 'device'
  return 'tcp'


@functools.cache
def _backend() -> str:
  return jax.default_backend()


def transport(nbytes: int) -> str:
  """The name of the transport of a payload of `nbytes` per process, on this job."""
  return choose_transport(_backend(), nbytes, override=settings.transport())


def choose(nbytes: int) -> interface.Transport:
  """The transport that moves a payload of `nbytes` per process (the same on every process)."""
  return chain.TCP if transport(nbytes) == 'tcp' else device.DEVICE


def tcp_enabled() -> bool:
  """Whether small payloads travel over TCP (else in the control plane's headers)."""
  return transport(0) == 'tcp'


def carries_small_payloads() -> bool:
  """Whether small payloads of arrays travel here rather than in the headers.

  Over TCP, once the agreement barrier has passed, a small payload takes one
  hop per process on an open connection, where the key-value store takes
  one or two more RPCs. A device
  collective is slower than those RPCs, so with it small payloads stay in
  the headers. Once calls agree over the TCP links (`control.links`), the
  headers travel there, so small payloads ride along: no second phase.
  """
  # (Agreeing over the links first: the steady state's answer, read
  # without the transport's setting.)
  return not link.agreeing(runtime.current()) and tcp_enabled()


def _over_links(rt: runtime.Runtime, length: int) -> bool:
  """Whether a payload of `length` bytes moves over the TCP links right after an agreement over them (not through the stage, which starts after the agreement): what a broadcast's early stripe and its relayed answers need."""
  return (transport(length) == 'tcp' and link.agreeing(rt)
          and not shared.carries(rt.plane, length))


def early_stripe(parts: list[np.ndarray], length: int) -> _eager.Eager | None:
  """A broadcast source's first stripe, to send during the agreement (`tcp.eager.Eager`), where its payload moves over TCP and calls agree over the links; else None."""
  if not _over_links(runtime.current(), length):
    return None
  return _eager.Eager(parts, length)


def relay(length: int) -> tree.Relay | None:
  """Where this process keeps the agreement's answer for its children, to send it on with a default-source broadcast's payload of `length` bytes (`tcp.tree.Relay`): where the call agrees over the links in a star and the payload goes down the tree over TCP; else None.

  The same answer on every process whose call agrees with the others'
  (every input is in the agreement or the same everywhere).
  """
  rt = runtime.current()
  plane = rt.plane
  # (The star first: at 2 processes, or between hosts, that is all.)
  if (plane is None or not plane.star or not tree.carries(rt.count, length)
      or not _over_links(rt, length)):
    return None
  return tree.Relay()


@overload
def broadcast(parts: list[np.ndarray] | None, length: int, source: int, *,
              op: str, timeout: float, source_result: Literal[True] = True,
              early: _eager.Eager | None = None,
              relay: tree.Relay | None = None) -> np.ndarray:
  ...


@overload
def broadcast(parts: list[np.ndarray] | None, length: int, source: int, *,
              op: str, timeout: float, source_result: bool,
              early: _eager.Eager | None = None,
              relay: tree.Relay | None = None) -> np.ndarray | None:
  ...


def broadcast(parts: list[np.ndarray] | None, length: int, source: int, *,
              op: str, timeout: float, source_result: bool = True,
              early: _eager.Eager | None = None,
              relay: tree.Relay | None = None) -> np.ndarray | None:
  """The source's `length` bytes, on every process, over the chosen transport (see `Transport.broadcast`); a timeout says where the late peers are.

  Collective: every process must call this, in the same order, with the
  same `length` and `source`. Every process gets the bytes, but the source
  with `source_result=False`.
  """
  try:
    return choose(length).broadcast(parts, length, source, op=op,
                                    timeout=timeout,
                                    source_result=source_result, early=early,
                                    relay=relay)
  except errors.CollectiveTimeoutError as e:
    raise where.with_whereabouts(e) from e


def allgather(buffer: np.ndarray, sizes: list[int], *, op: str,
              timeout: float) -> np.ndarray:
  """Every process's bytes, as rows: process p's are rows[p, :sizes[p]], over the chosen transport (see `Transport.allgather`).

  Collective: every process must call this, in the same order, with the
  same `sizes`.
  """
  try:
    return choose(max(sizes)).allgather(buffer, sizes, op=op, timeout=timeout)
  except errors.CollectiveTimeoutError as e:
    raise where.with_whereabouts(e) from e


def exchange(sends: dict[int, list], incoming: dict[int, int], *, op: str,
             timeout: float) -> dict[int, np.ndarray]:
  """Each destination's bytes, sent to it alone, over the TCP links whatever the transport (see `Transport.exchange`); a timeout says where the late peers are."""
  try:
    return chain.TCP.exchange(sends, incoming, op=op, timeout=timeout)
  except errors.CollectiveTimeoutError as e:
    raise where.with_whereabouts(e) from e
