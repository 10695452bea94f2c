"""Data plane: bulk bytes between processes over TCP (the default transport of large payloads).

Why not a device collective: on CPU, JAX's gloo collectives move bytes
several times slower than plain TCP between the same processes
(measured when the transports were chosen; no doc keeps that table now). The payloads of `broadcast_one_to_all`,
`process_allgather` and the object collectives are host values (numpy in,
numpy out), so they go host to host: for broadcast among processes that
all run on one host, from `shared.SHARED_FROM` bytes, through the source's
stage (`tcp.shared`); otherwise a binomial tree when the
payload is one stripe (below `payload.STRIPE_BYTES`) and there are 3 processes or
more (ceil(log2 P) hops where a chain takes P - 1), else a pipelined
chain per stripe (memory and source traffic do not grow with the process
count); a ring for all-gather. Set MULTIHOST_TRANSPORT=device to use a
device collective instead (e.g. where peers cannot open TCP connections to
each other).

This module chooses the algorithm and holds the chain and the ring; the
stage's broadcast is `tcp.shared`'s, the tree `tcp.tree`'s, how a
payload is framed, cut and sent `tcp.payload`'s, the source's early
stripe `tcp.eager`'s, the links they run on `tcp.link`'s and their
socket I/O `tcp.sockets`'s, the threads they run on `tcp.threads`'s.
Every socket wait is bounded by the collective's timeout; a peer that dies
closes its sockets, which raises here at once.
"""

from __future__ import annotations

import functools
import time

import numpy as np

from multihost._src.runtime import errors
from multihost._src.runtime.deadline import Deadline
from multihost._src.transport import buffers
from multihost._src.transport.tcp import eager as _eager
from multihost._src.transport.tcp import link as _tcp_link
from multihost._src.transport.tcp import pairs
from multihost._src.transport.tcp import payload
from multihost._src.transport.tcp import shared
from multihost._src.transport.tcp import sockets
from multihost._src.transport.tcp import threads
from multihost._src.transport.tcp import tree


def first_peer(plane: _tcp_link.Plane, length: int) -> int:
  """The process a broadcast's source (this process) sends its `length` bytes to first: down the tree its first child (the largest subtree's root), else the next process in the chain. Its early stripe (`tcp.eager.Eager`) goes there."""
  if tree.carries(plane.count, length):
    return (plane.me + tree.first_child(plane.count)) % plane.count
  return (plane.me + 1) % plane.count


def broadcast(parts: list[np.ndarray] | None, length: int, source: int, *,
              op: str, timeout: float, source_result: bool = True,
              eager: _eager.Eager | None = None,
              relay: tree.Relay | None = None) -> np.ndarray | None:
  """Returns the source's `length` bytes on every process (through the source's stage on one host, a binomial tree, or a pipelined chain per lane).

  Collective: every process must call this, in the same order, with the
  same `length` and `source`; the source passes its parts (C-contiguous
  arrays, `length` bytes in all), the others None. The source sends from
  the parts themselves; its own result (a packed copy, made piece by piece
  behind the sends, or beside them on the plane's copier thread where its
  host has a core to spare: `tcp.eager.Eager`) is None with
  `source_result=False`. Receivers read straight into the result.

  Among processes of one host a payload of `shared.SHARED_FROM` bytes or
  more goes through the source's stage (`tcp.shared`). Otherwise a payload
  of one stripe among 3 processes or more goes down a binomial tree
  (`tcp.tree`). A payload of `payload.STRIPE_BYTES` or more is cut
  into one stripe per lane (`Plane.lanes` connections per pair of processes), each moving down its
  own chain at once: the first on the calling thread, the others on the
  plane's lane threads. One TCP stream is limited by the one core that
  copies its bytes in and out of the kernel; two keep two cores copying.
  With a started `eager` (the source's), the first
  stripe's frame is already partly sent; with a `relay` holding the
  agreement's answer, it goes down the tree with the payload.
  """
  deadline = time.monotonic() + timeout
  plane = _tcp_link.get_plane(op, deadline)
  call = plane.seq
  rank = (plane.me - source) % plane.count
  if shared.carries(plane, length):
    out = buffers.take(length) if rank > 0 or source_result else None
    shared.broadcast(plane, call, source, length, parts, out, op, deadline)
    return out
  eager = eager if eager and eager.link else None
  if eager is not None and eager.copying is not None:
    # The source's result is being copied on the copier thread.
    result = eager.out
    out = None
  else:
    out = result = (buffers.take(length) if rank > 0 or source_result
                    else None)
  ranges = payload.stripes(length, plane.lanes)
  pieces: list = ([None] * len(ranges) if rank > 0
                  else payload.pieces(_parts(parts, op, plane.me), ranges))
  if tree.carries(plane.count, length):
    tree.broadcast(plane, call, source, length, pieces[0], out, op,
                   deadline, eager, relay)
    _copied(eager, deadline)
    return result
  jobs = [plane.lane_threads[lane - 1].run(functools.partial(
      _chain, plane, lane, call, source, ranges[lane], pieces[lane], out, op,
      deadline, True)) for lane in range(1, len(ranges))]
  error: BaseException | None = None
  try:
    _chain(plane, 0, call, source, ranges[0], pieces[0], out, op, deadline,
           len(ranges) > 1, eager)
  except errors.MultihostError as e:
    error = e  # The links are closed: the other lanes end within a slice.
  for job in jobs:
    failed = job.wait(deadline + 2 * sockets.SLICE_S)
    error = error or failed
  if error is not None:
    if not isinstance(error, errors.MultihostError):
      raise payload.failed(plane, None, op, source, error,
                           deadline=deadline) from error
    raise error
  _copied(eager, deadline)
  return result


def _parts(parts: list[np.ndarray] | None, op: str,
           me: int) -> list[np.ndarray]:
  """The source's `parts`, which it must pass (a None here is a bug)."""
  if parts is None:
    raise errors.MultihostError(
        f'{op}: process {me}, the source, passed no parts to send.')
  return parts


def _copied(eager: _eager.Eager | None, deadline: float) -> None:
  """Waits for the source's own result, where its copier thread makes it (`tcp.eager.Eager`)."""
  if eager is not None and eager.copying is not None:
    eager.copying.join(deadline)  # (a local failure: the links are as they were)


def _chain(plane: _tcp_link.Plane, lane: int, call: int, source: int,
           stripe: tuple[int, int], piece: list | None,
           out: np.ndarray | None, op: str, deadline: float,
           striped: bool, eager: _eager.Eager | None = None) -> None:
  """Moves bytes `stripe` of the payload down the chain on `lane`.

  The source sends `piece` (its parts when the payload is one stripe, else
  views of its bytes of the stripe, `striped`), or the rest of its started
  `eager` frame; every other process reads into `out[start:stop]` and
  forwards down the chain.
  """
  me, count = plane.me, plane.count
  start, stop = stripe
  n = stop - start
  rank = (me - source) % count
  prev = (me - 1) % count
  nxt = (me + 1) % count if rank < count - 1 else None
  watch = Deadline(op, deadline, plane.rt.watchdog)
  # The source sends on its thread (it has no reads to keep going
  # meanwhile); a process in the middle of the chain forwards on a sender
  # (lane 0) or on its lane's thread between reads (the others).
  sender: threads.Sender | threads.DirectSender | None = None
  if nxt is not None and rank > 0:
    # A stripe of one chunk is read whole before any of it is forwarded:
    # a thread would have no read to overlap, only a handoff to add.
    sender = (threads.sender(watch, n, plane.sends)
              if lane == 0 and n > payload.CHUNK
              else threads.DirectSender(watch))
  peer = nxt if rank == 0 and nxt is not None else prev
  target = None if out is None else out[start:stop]
  try:
    down = plane.conn(nxt, deadline, op, lane) if nxt is not None else None
    if down is not None:
      payload.arm(down, deadline)
    if rank == 0 and eager is not None:
      if down is None or down is not eager.link:  # (closed meanwhile)
        raise ConnectionResetError('the link was closed after the agreement')
      payload.send_and_copy(down, eager.segments, eager.head, target,
                            watch, eager.sent)
    elif rank == 0:
      if down is None or piece is None:
        raise errors.MultihostError(
            f'{op}: process {me}, the source, has no link down the chain '
            'or nothing to send on it.')
      head = down.frame(call, n)
      payload.send_and_copy(down, payload.framed(head, piece, striped),
                            len(head), target, watch)
    else:
      if target is None:
        raise errors.MultihostError(
            f'{op}: process {me} has no result to receive into.')
      view = target.data
      # A sender exists exactly where a link down the chain does.
      if down is not None and sender is not None:
        sender.send(down.sock, down.frame(call, n))
      up = plane.conn(prev, deadline, op, lane)
      payload.arm(up, deadline)
      if down is None:  # The end of the chain: one read into the result.
        up.read_frame_into(call, view, op, prev, watch)
      else:
        up.read_frame(call, n, op, prev, watch)
      if down is not None and sender is not None:
        for at in range(0, n, payload.CHUNK):
          chunk = view[at:at + payload.CHUNK]
          up.recv_into(chunk, watch)
          sender.send(down.sock, chunk)
    if sender is not None and nxt is not None:
      peer = nxt
      done, sender = sender, None
      done.close(deadline)
  except (OSError, TimeoutError, errors.MultihostError) as e:
    raise payload.failed(plane, sender, op, peer, e,
                         deadline=deadline) from e


def allgather(buffer: np.ndarray, sizes: list[int], *, op: str,
              timeout: float) -> np.ndarray:
  """Every process's bytes, as rows: process p's are rows[p, :sizes[p]] (a ring).

  Collective: every process must call this, in the same order, with the
  same `sizes`.
  """
  deadline = time.monotonic() + timeout
  plane = _tcp_link.get_plane(op, deadline)
  me, count = plane.me, plane.count
  call = plane.seq
  prev, nxt = (me - 1) % count, (me + 1) % count
  rows = buffers.take(count * max(sizes)).reshape(count, max(sizes))
  mine = buffer.reshape(-1)[:sizes[me]]
  blocks = [rows[p, :n] for p, n in enumerate(sizes)]
  copied = False
  peer = prev
  watch = Deadline(op, deadline, plane.rt.watchdog)
  ring = threads.sender(watch, max(sizes), plane.sends)
  # The sender `payload.failed` stops, if the ring fails before it closed.
  sender: threads.Sender | threads.DirectSender | None = ring
  try:
    down = plane.conn(nxt, deadline, op)
    up = plane.conn(prev, deadline, op)
    payload.arm(down, deadline)
    payload.arm(up, deadline)
    for step in range(count - 1):
      out_block = (me - step) % count
      in_block = (me - step - 1) % count
      ring.send(down.sock, down.frame(call, sizes[out_block]))
      # The first block is this process's own: it goes out from the
      # caller's buffer, and is copied into the result while it does.
      ring.send(down.sock, (mine if step == 0 else blocks[out_block]).data)
      if not copied:
        blocks[me][:] = mine
        copied = True
      up.read_frame_into(call, blocks[in_block].data, op, prev, watch)
      if ring.error is not None:
        raise ring.error
    if not copied:
      blocks[me][:] = mine
    peer = nxt
    sender = None
    ring.close(deadline)
  except (OSError, TimeoutError, errors.MultihostError) as e:
    raise payload.failed(plane, sender, op, peer, e,
                         deadline=deadline) from e
  return rows


class TcpTransport:
  """The `Transport` over the authenticated TCP links: a pipelined chain per lane for broadcast, a ring for all-gather, one frame per pair for an exchange (`tcp.pairs`)."""

  name = 'tcp'

  def broadcast(self, parts: list[np.ndarray] | None, length: int,
                source: int, *, op: str, timeout: float,
                source_result: bool = True,
                early: object | None = None,
                relay: object | None = None) -> np.ndarray | None:
    """See `Transport.broadcast`; `early` and `relay` are this transport's own (`choice.early_stripe`, `choice.relay`)."""
    if not isinstance(early, (_eager.Eager, type(None))) or not isinstance(
        relay, (tree.Relay, type(None))):
      raise TypeError(
          f'{op}: the TCP transport got another transport\'s early stripe '
          f'or relay ({type(early).__name__}, {type(relay).__name__}).')
    return broadcast(parts, length, source, op=op, timeout=timeout,
                     source_result=source_result, eager=early, relay=relay)

  def allgather(self, buffer: np.ndarray, sizes: list[int], *, op: str,
                timeout: float) -> np.ndarray:
    """See `Transport.allgather`."""
    return allgather(buffer, sizes, op=op, timeout=timeout)

  def exchange(self, sends: dict[int, list], incoming: dict[int, int], *,
               op: str, timeout: float) -> dict[int, np.ndarray]:
    """See `Transport.exchange`."""
    return pairs.exchange(sends, incoming, op=op, timeout=timeout)


TCP = TcpTransport()
