"""Data plane: a broadcast source's first stripe, sent during the call's agreement (`Eager`)."""

from __future__ import annotations

import functools

import numpy as np

from multihost._src.runtime import leaves
from multihost._src.transport import buffers
from multihost._src.transport.tcp import link as _tcp_link
from multihost._src.transport.tcp import payload
from multihost._src.transport.tcp import sockets
from multihost._src.transport.tcp import threads

# What a broadcast's source sends during the agreement (`Eager`), at most:
# a small payload whole; of a large one only its start, so that the
# lanes' stripes still go out side by side once the agreement passed.
EAGER_BYTES = 2 << 20
# A source whose host has a core to spare (`Plane.spare_cores`) copies its
# own result on the plane's copier thread, beside its sends, for payloads
# of one stripe from this size: on a 16-core machine the copy was 0.14-0.26
# ms of the source's 0.45-0.52 ms of CPU in a 1 MiB broadcast at P=2, and
# the source the slower process (a run on that machine; docs/performance.md's
# tables are of the 2-core machine).
ASIDE_FROM = 256 << 10


class Eager:
  """A broadcast source's first stripe, sent ahead of the call's agreement as far as the socket takes it without waiting (up to EAGER_BYTES).

  The agreement over the links (`control.rounds.agree`) starts it right
  behind its frame to the process the transfer sends to first
  (`tcp.chain.first_peer`: the tree's first child, or the next process in
  the chain), so the bytes are on their way while the agreement's
  messages are. Only the
  source of a default-source broadcast starts one: every process knows who
  the source is before agreeing. It is the transfer's own data frame of
  stripe 0, with the id every process gives the call's transfer
  (`link.transfer_id`); the broadcast (`tcp.chain`, `tcp.tree`) sends its
  rest.

  All or none, as for any call over the links: a process that completed
  the agreement goes on to read the frame and returns its payload; after a
  timeout every process raises (the call's outcome record decides when one
  gave up while others completed, see `control.rounds`), and a process
  that did not read the frame drops it in its next agreement
  (`control.rounds._receive`). So a receiver never waits for the source to
  end its agreement: at two processes a call costs each side one wake-up,
  not two in turn. On a difference or a timeout the source's link owes the
  rest of the frame (`defer`: sent at once as far as the socket takes it,
  the remainder before anything else on that link); if the call still
  goes on to a transfer (the headers agreed after all), the frame is its
  stripe 0 and is not sent again.
  """

  def __init__(self, parts: list[np.ndarray], length: int):
    self.parts = parts
    self.length = length
    self.link: _tcp_link.Link | None = None  # set once started
    self.to: int | None = None  # the process it went to, once started
    self.segments: list[memoryview] = []
    self.head = 0  # frame header bytes at the start of `segments`
    self.sent = 0  # bytes of `segments` sent (or owed: `defer`)
    # The source's own result, being copied on the plane's copier thread
    # (`copying`), where `start` set that going; else None.
    self.out: np.ndarray | None = None
    self.copying: threads.Job | None = None

  def start(self, plane: _tcp_link.Plane, link: _tcp_link.Link,
            to: int) -> None:
    """Sends the frame of stripe 0 to process `to` (`tcp.chain.first_peer`) on `link`, up to what its socket takes now."""
    ranges = payload.stripes(self.length, plane.lanes)
    if plane.spare_cores and ASIDE_FROM <= self.length < payload.STRIPE_BYTES:
      # First, so that the copy runs while this thread sends.
      self.out = buffers.take(self.length)
      self.copying = plane.copier.run(
          functools.partial(leaves.pack_into, self.out, self.parts))
    a, b = ranges[0]
    head = link.frame(_tcp_link.transfer_id(plane), b - a)
    piece = payload.pieces(self.parts, ranges)[0]
    self.segments = [memoryview(x).cast('B')
                     for x in payload.framed(head, piece, len(ranges) > 1)]
    self.head = len(head)
    self.link, self.to = link, to
    self.sent = sockets.send_ready(link.sock, self.segments, EAGER_BYTES)

  def defer(self) -> None:
    """Ends the frame after a difference or a timeout: the rest is sent at once as far as the socket takes it, and the link owes the remainder (sent before its next use: `Plane.conn`)."""
    if self.link is None:
      raise RuntimeError('Eager.defer() called before Eager.start().')
    rest = payload.cut(self.segments, self.sent, payload.ALL)
    self.sent = sum(len(x) for x in self.segments)
    try:
      sent = sockets.send_ready(self.link.sock, rest, payload.ALL)
    except OSError:
      sent = 0  # (the link is broken: its next use finds it closed)
    self.link.owed = payload.cut(rest, sent, payload.ALL) or None
