"""Data plane: how a transfer's payload is framed, cut into stripes and sent (what the chain, the tree and the early stripe share).

The source sends from its own arrays (large parts as views, small ones
joined) and copies each piece into its result right behind its send;
`stripes` cuts a large payload into one stripe per lane. `failed` is the
one way a transfer over the links ends on an error.
"""

from __future__ import annotations

import time

import numpy as np

from multihost._src.runtime import errors
from multihost._src.runtime.deadline import Deadline
from multihost._src.transport.tcp import errors as tcp_errors
from multihost._src.transport.tcp import link as _tcp_link
from multihost._src.transport.tcp import sockets
from multihost._src.transport.tcp import threads

# Bytes a process reads before forwarding them down the chain,
# and what the source sends before copying it into its own result.
CHUNK = 4 << 20
# Parts smaller than this are joined before sending (see `segments`).
JOIN_BELOW = 64 << 10
# Broadcasts of at least this many bytes are cut into one stripe per lane
# (`stripes`), stripes aligned to this many bytes.
STRIPE_BYTES = 4 << 20
ALIGN = 4096
# Past the end of any payload (`cut`'s stop, `send_ready`'s limit).
ALL = 1 << 62


def failed(plane: _tcp_link.Plane,
           sender: threads.Sender | threads.DirectSender | None, op: str,
           peer: int, error: BaseException, *,
           deadline: float) -> errors.MultihostError:
  """Stops a failed transfer; returns the named error to raise (waiting for the watchdog to name a dead process no later than the transfer's `deadline`: `tcp.errors.peer_error`)."""
  if sender is not None:
    sender.finish(time.monotonic() + 0.1)
  _tcp_link.break_plane(plane, error)
  return tcp_errors.peer_error(op, peer, error, plane.rt.watchdog,
                               deadline=deadline)


def arm(link: _tcp_link.Link, deadline: float) -> None:
  """Sets `link`'s socket timeout for a transfer: one slice, or what is left before `deadline` if less."""
  sockets.set_timeout(
      link.sock, max(min(deadline - time.monotonic(), sockets.SLICE_S), 0.001))


def segments(head: bytes, parts: list[np.ndarray]) -> list:
  """What to send for `head` then `parts`: large parts as views, small ones joined.

  A large part goes out from its own memory (no copy); runs of small parts
  (and the frame header before them) are joined into one buffer, so a
  many-leaf tree of small leaves is a few sends, not one per leaf.
  """
  out: list = []
  run: list = [head]
  for part in parts:
    view = part.reshape(-1).view(np.uint8).data
    if len(view) >= JOIN_BELOW:
      if run:
        out.append(b''.join(run))
        run = []
      out.append(view)
    elif len(view):
      run.append(view)
  if run:
    out.append(b''.join(run))
  return out


def send_and_copy(down: _tcp_link.Link, segments_: list, skip: int,
                  out: np.ndarray | None, watch: Deadline,
                  already: int = 0) -> None:
  """Sends `segments_` down the chain; with `out`, copies the payload there too.

  The copy goes piece by piece right after each piece is sent, while the
  piece is still in the CPU's cache and the socket buffers keep the next
  process reading: a copy after the whole send would read the leaves from
  memory again and delay the source's return by all of it. The first
  `skip` bytes are the frame header, not payload; the first `already`
  bytes were sent before (`Eager`), and are only copied. A header in a
  segment of its own goes out in one write with the piece behind it
  (`sockets.send_views`): the reader wakes once for both.
  """
  offset = 0
  head = None  # a frame header alone, sent with the piece behind it
  for segment in segments_:
    view = memoryview(segment).cast('B')
    for at in range(0, len(view), CHUNK):
      piece = view[at:at + CHUNK]
      if already >= len(piece):
        already -= len(piece)
      elif head is None and already == 0 and skip >= len(piece):
        head = piece  # (holds no payload: nothing to copy)
      else:
        sockets.send_views(down.sock, [piece[already:]] if head is None
                           else [head, piece[already:]], watch)
        head = None
        already = 0
      if out is not None:
        body = piece[skip:]
        skip = max(skip - len(piece), 0)
        out[offset:offset + len(body)] = np.frombuffer(body, np.uint8)
        offset += len(body)
  if head is not None:  # (a frame without payload)
    sockets.send_all(down.sock, head, watch)


def stripes(length: int, lanes: int) -> list[tuple[int, int]]:
  """The byte ranges a broadcast of `length` bytes sends on each lane (one unless large)."""
  if lanes <= 1 or length < STRIPE_BYTES:
    return [(0, length)]
  step = -(-length // lanes)
  step = -(-step // ALIGN) * ALIGN
  return [(a, min(a + step, length)) for a in range(0, length, step)]


def pieces(parts: list[np.ndarray], ranges: list[tuple[int, int]]) -> list:
  """What the source sends of each stripe: its parts when there is one stripe, else views of each stripe's bytes."""
  if len(ranges) == 1:
    return [parts]
  views = [memoryview(s).cast('B') for s in segments(b'', parts)]
  return [cut(views, a, b) for a, b in ranges]


def framed(head: bytes, piece: list, striped: bool) -> list:
  """`head` then a stripe's `piece` (see `pieces`), as the segments to send."""
  return [head, *piece] if striped else segments(head, piece)


def cut(views: list[memoryview], start: int, stop: int) -> list[memoryview]:
  """Views of bytes [start, stop) of the concatenation of `views`."""
  out, at = [], 0
  for view in views:
    lo, hi = max(start - at, 0), min(stop - at, len(view))
    if lo < hi:
      out.append(view[lo:hi])
    at += len(view)
  return out


def drop(link: _tcp_link.Link, length: int, watch: Deadline) -> None:
  """Reads and drops the `length` bytes of a frame whose header was read."""
  scratch = memoryview(bytearray(min(length, CHUNK)))
  while length:
    n = min(length, len(scratch))
    link.recv_into(scratch[:n], watch)
    length -= n
