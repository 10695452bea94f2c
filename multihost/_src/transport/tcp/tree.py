"""Data plane: a broadcast of one stripe down a binomial tree rooted at the source (ceil(log2 P) hops where the chain takes P - 1).

`tcp.chain.broadcast` sends payloads below `payload.STRIPE_BYTES` among 3
processes or more this way; at each hop the whole payload is read before
it goes on, so a tree pays off where the payload is small next to the
chain's hops. Where calls agree in a star, a default-source broadcast's
agreement answers take the same tree's path, and when every process
agreed the payload's frames are the answers (`Relay`).
"""

from __future__ import annotations

import numpy as np

from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime.deadline import Deadline
from multihost._src.transport.tcp import eager as _eager
from multihost._src.transport.tcp import link as _tcp_link
from multihost._src.transport.tcp import payload
from multihost._src.transport.tcp import sockets


class Relay:
  """A default-source broadcast's agreement in a star (`control.rounds`) whose payload goes down this tree next: the answers take the tree's path.

  Every process given one takes its answer from its parent in the tree
  rooted at process 0, and says so in its frame to process 0. When every
  process did, agreed, and gave the same timeout, no answer is sent:
  the payload's frame, which comes from the parent next anyway, is the
  answer. The agreement reads its header (`folded`: the payload's
  length); the transfer reads the payload (`broadcast`). So each process
  wakes once for both, and process 0 sends nothing but the payload.
  Otherwise (a difference, differing timeouts) the answers go as in any
  star, each passed on down the tree to the processes that wait for it
  there.
  """

  __slots__ = ('folded',)

  def __init__(self):
    self.folded: int | None = None


def carries(count: int, length: int) -> bool:
  """Whether a broadcast of `length` bytes among `count` processes goes down the tree: below `payload.STRIPE_BYTES` (larger ones pipeline down the chains, however many lanes), 3 processes or more."""
  return count > 2 and length < payload.STRIPE_BYTES


def tree_peers(rank: int, count: int) -> tuple[int | None, list[int]]:
  """(parent, children) of relative `rank` in the binomial tree of `count` processes rooted at rank 0; children largest subtree first."""
  mask = 1
  while mask < count and not rank & mask:
    mask <<= 1
  parent = rank - mask if rank else None
  children = []
  mask >>= 1
  while mask:
    if rank + mask < count:
      children.append(rank + mask)
    mask >>= 1
  return parent, children


def first_child(count: int) -> int:
  """The relative rank the root sends to first: its largest subtree's (the largest power of 2 below `count`)."""
  return tree_peers(0, count)[1][0]


def broadcast(plane: _tcp_link.Plane, call: int, source: int, n: int,
              piece: list | None, out: np.ndarray | None, op: str,
              deadline: float, eager: _eager.Eager | None,
              relay: Relay | None = None) -> None:
  """Moves a payload of one stripe down a binomial tree rooted at the source: ceil(log2 P) hops where the chain takes P - 1.

  Every process but the source reads the whole payload into `out` from
  its parent, then sends it to its children, largest subtree first. The
  source sends `piece` (its parts) to each child, copying into `out` (if
  any) behind its first send; its frame to its first child (`first_child`,
  its largest subtree) may be its started `eager` one, of which only the
  rest is sent. Where the agreement read the payload's frame header as
  its answer (`relay.folded`), only the payload is left to read.
  """
  me, count = plane.me, plane.count
  rank = (me - source) % count
  parent, children = tree_peers(rank, count)
  watch = Deadline(op, deadline, plane.rt.watchdog)
  peer = me
  try:
    if parent is not None:
      peer = (parent + source) % count
      if out is None:
        raise errors.MultihostError(
            f'{op}: process {me} has no result to receive into.')
      up = plane.conn(peer, deadline, op)
      payload.arm(up, deadline)
      if relay is not None and relay.folded is not None:
        if relay.folded != n:
          raise failures.out_of_step(op, peer, (call, relay.folded),
                                     (call, n))
        up.recv_into(out.data, watch)
      else:
        up.read_frame_into(call, out.data, op, peer, watch)
    target = out if parent is None else None  # (the source copies once)
    for child in children:
      peer = (child + source) % count
      down = plane.conn(peer, deadline, op)
      payload.arm(down, deadline)
      if parent is not None:
        sockets.send_views(down.sock, [down.frame(call, n), out], watch)
        continue
      if eager is not None and peer == eager.to:
        if down is not eager.link:  # (the links were closed meanwhile)
          raise ConnectionResetError('the link was closed after the agreement')
        payload.send_and_copy(down, eager.segments, eager.head, target,
                              watch, eager.sent)
      else:
        if piece is None:
          raise errors.MultihostError(
              f'{op}: process {me}, the source, passed nothing to send.')
        head = down.frame(call, n)
        payload.send_and_copy(down, payload.segments(head, piece), len(head),
                              target, watch)
      target = None
  except (OSError, TimeoutError, errors.MultihostError) as e:
    raise payload.failed(plane, None, op, peer, e, deadline=deadline) from e
