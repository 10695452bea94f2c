"""The `Transport` interface: how a call's payload bytes move between processes once every process agreed on the call.

Two implementations: TCP between the hosts (`tcp.chain.TCP`) and JAX
device collectives (`device.DEVICE`); `choice.choose` picks one per
payload. A point-to-point exchange always moves over the TCP links (a
device collective has no way to send to one process only). Both take and return host bytes (uint8 numpy arrays) and raise the
same errors, so a collective never knows which one moved its bytes.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Transport(Protocol):
  """Moves a call's payload bytes between processes (broadcast and all-gather are collective: every process calls the same method, in the same order, with the same sizes)."""

  name: str

  def broadcast(self, parts: list[np.ndarray] | None, length: int,
                source: int, *, op: str, timeout: float,
                source_result: bool = True,
                early: object | None = None,
                relay: object | None = None) -> np.ndarray | None:
    """The source's `length` bytes, on every process.

    Args:
      parts: the source's C-contiguous arrays, `length` bytes in all (None
        on the other processes).
      length: the payload's size, the same on every process.
      source: the source's process index.
      op: the collective's name, for errors.
      timeout: seconds for the whole transfer.
      source_result: whether the source gets a copy back (else None).
      early: what the source started sending during the agreement (see
        `choice.early_stripe`), or None.
      relay: where this process keeps the agreement's answer for the
        processes it sends the payload to (see `choice.relay`), or None.

    Raises:
      CollectiveTimeoutError: the transfer did not complete in time.
      ProcessFailureError: a peer is gone.
      MultihostError: a peer's bytes were refused.
    """
    ...

  def allgather(self, buffer: np.ndarray, sizes: list[int], *, op: str,
                timeout: float) -> np.ndarray:
    """Every process's bytes, as rows: process p's are `rows[p, :sizes[p]]`.

    Args:
      buffer: this process's bytes (uint8, at least `sizes[me]` of them).
      sizes: every process's size, the same list on every process.
      op: the collective's name, for errors.
      timeout: seconds for the whole transfer.

    Raises:
      As `broadcast`.
    """
    ...

  def exchange(self, sends: dict[int, list], incoming: dict[int, int], *,
               op: str, timeout: float) -> dict[int, np.ndarray]:
    """Each destination's bytes, sent to it alone; returns each source's.

    Not collective over every process: over the processes named, each of
    which calls it with this process among its sources or destinations
    (the caller's agreement proves the pattern first).

    Args:
      sends: destination process -> bytes-like segments, sent in order.
      incoming: source process -> the bytes it sends here.
      op: the call's name, for errors.
      timeout: seconds for the whole transfer.

    Returns:
      source process -> its bytes (uint8).

    Raises:
      As `broadcast`.
    """
    ...
