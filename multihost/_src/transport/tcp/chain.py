"""Data plane: bulk bytes between processes over TCP (the default transport of large payloads).

Why not a device collective: on CPU, JAX's gloo collectives move bytes
several times slower than plain TCP between the same processes (see
bench/README.md). The payloads of `broadcast_one_to_all`,
`process_allgather` and the object collectives are host values (numpy in,
numpy out), so they go host to host: for broadcast a binomial tree when the
payload is one stripe (below `STRIPE_BYTES`) and there are 3 processes or
more (ceil(log2 P) hops where a chain takes P - 1), else a pipelined
chain per stripe (memory and source traffic do not grow with the process
count); a ring for all-gather. Set MULTIHOST_TRANSPORT=device to use a
device collective instead (e.g. where peers cannot open TCP connections to
each other).

This module holds the transfer algorithms; the links they run on are
`transport.tcp.link`'s, their socket I/O `transport.tcp.sockets`'s. Every socket wait is bounded by
the collective's timeout; a peer that dies closes its sockets, which raises
here at once.
"""

from __future__ import annotations

import functools
import time

import numpy as np

from multihost._src.runtime import errors
from multihost._src.runtime.deadline import Deadline
from multihost._src.transport import buffers
from multihost._src.transport.tcp import errors as tcp_errors
from multihost._src.transport.tcp import link as _tcp_link
from multihost._src.transport.tcp import sockets

# and what the source sends before copying it into its own result.
_CHUNK = 4 << 20
# Parts smaller than this are joined before sending (see `segments`).
_JOIN_BELOW = 64 << 10
# Broadcasts of at least this many bytes are cut into one stripe per lane
# (`stripes`), stripes aligned to this many bytes.
STRIPE_BYTES = 4 << 20
_ALIGN = 4096
# What a broadcast's source sends during the agreement (`Eager`), at most:
# a small payload whole; of a large one only its start, so that the
# lanes' stripes still go out side by side once the agreement passed.
EAGER_BYTES = 2 << 20


def _failed(plane: _tcp_link.Plane,
            sender: sockets.Sender | sockets.DirectSender | None, op: str,
            peer: int, error: BaseException) -> errors.MultihostError:
  """Stops a failed transfer; returns the named error to raise."""
  if sender is not None:
    sender.finish(time.monotonic() + 0.1)
  _tcp_link.break_plane(plane, error)
  return tcp_errors.peer_error(op, peer, error, plane.rt.watchdog)


def _start(op: str, peer: int, link: _tcp_link.Link, deadline: float) -> None:
  link.sock.settimeout(
      max(min(deadline - time.monotonic(), sockets.SLICE_S), 0.001))


def segments(head: bytes, parts: list[np.ndarray]) -> list:
  """What to send for `head` then `parts`: large parts as views, small ones joined.

  A large part goes out from its own memory (no copy); runs of small parts
  (and the frame header before them) are joined into one buffer, so a
  many-leaf tree of small leaves is a few sends, not one per leaf.
  """
  out: list = []
  run: list = [head]
  for part in parts:
    view = memoryview(part.reshape(-1).view(np.uint8))
    if len(view) >= _JOIN_BELOW:
      if run:
        out.append(b''.join(run))
        run = []
      out.append(view)
    elif len(view):
      run.append(view)
  if run:
    out.append(b''.join(run))
  return out


def _send_and_copy(down: _tcp_link.Link, segments_: list, skip: int,
                   out: np.ndarray | None, watch: Deadline,
                   already: int = 0) -> None:
  """Sends `segments_` down the chain; with `out`, copies the payload there too.

  The copy goes piece by piece right after each piece is sent, while the
  piece is still in the CPU's cache and the socket buffers keep the next
  process reading: a copy after the whole send would read the leaves from
  memory again and delay the source's return by all of it. The first
  `skip` bytes are the frame header, not payload; the first `already`
  bytes were sent before (`Eager`), and are only copied.
  """
  offset = 0
  for segment in segments_:
    view = memoryview(segment).cast('B')
    for start in range(0, len(view), _CHUNK):
      piece = view[start:start + _CHUNK]
      if already < len(piece):
        sockets.send_all(down.sock, piece[already:], watch)
        already = 0
      else:
        already -= len(piece)
      if out is not None:
        body = piece[skip:]
        skip = max(skip - len(piece), 0)
        out[offset:offset + len(body)] = np.frombuffer(body, np.uint8)
        offset += len(body)


def stripes(length: int, lanes: int) -> list[tuple[int, int]]:
  """The byte ranges a broadcast of `length` bytes sends on each lane (one unless large)."""
  if lanes <= 1 or length < STRIPE_BYTES:
    return [(0, length)]
  step = -(-length // lanes)
  step = -(-step // _ALIGN) * _ALIGN
  return [(a, min(a + step, length)) for a in range(0, length, step)]


def _pieces(parts: list[np.ndarray], ranges: list[tuple[int, int]]) -> list:
  """What the source sends of each stripe: its parts when there is one stripe, else views of each stripe's bytes."""
  if len(ranges) == 1:
    return [parts]
  views = [memoryview(s).cast('B') for s in segments(b'', parts)]
  return [_cut(views, a, b) for a, b in ranges]


def _framed(head: bytes, piece: list, striped: bool) -> list:
  """`head` then a stripe's `piece` (see `_pieces`), as the segments to send."""
  return [head, *piece] if striped else segments(head, piece)


# Past the end of any payload (`_cut`'s stop, `send_ready`'s limit).
_ALL = 1 << 62


def _cut(views: list[memoryview], start: int, stop: int) -> list[memoryview]:
  """Views of bytes [start, stop) of the concatenation of `views`."""
  out, at = [], 0
  for view in views:
    lo, hi = max(start - at, 0), min(stop - at, len(view))
    if lo < hi:
      out.append(view[lo:hi])
    at += len(view)
  return out


class Eager:
  """A broadcast source's first stripe, sent ahead of the call's agreement as far as the socket takes it without waiting (up to EAGER_BYTES).

  The agreement over the links (`control.links.agree`) starts it right
  after its first round's frame to the next process in the chain, so the
  bytes are on their way while the agreement's messages are. Only the
  source of a default-source broadcast starts one: every process knows who
  the source is before agreeing. It is the transfer's own data frame of
  stripe 0, with the id every process gives the call's transfer
  (`link.transfer_id`); `broadcast` sends its rest.

  All or none, as for any call over the links: a process that completed
  the agreement goes on to read the frame and returns its payload; after a
  timeout every process raises (the call's outcome record decides when one
  gave up while others completed, see `control.links`), and a process
  that did not read the frame drops it in its next agreement
  (`control.links._receive`). So a receiver never waits for the source to
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
    self.segments: list[memoryview] = []
    self.head = 0  # frame header bytes at the start of `segments`
    self.sent = 0  # bytes of `segments` sent (or owed: `defer`)

  def start(self, plane: _tcp_link.Plane, link: _tcp_link.Link) -> None:
    """Sends the frame of stripe 0 to `link` (the next process's), up to what its socket takes now."""
    ranges = stripes(self.length, plane.lanes)
    a, b = ranges[0]
    head = link.frame(_tcp_link.transfer_id(plane), b - a)
    piece = _pieces(self.parts, ranges)[0]
    self.segments = [memoryview(x).cast('B')
                     for x in _framed(head, piece, len(ranges) > 1)]
    self.head = len(head)
    self.link = link
    self.sent = sockets.send_ready(link.sock, self.segments, EAGER_BYTES)

  def defer(self) -> None:
    """Ends the frame after a difference or a timeout: the rest is sent at once as far as the socket takes it, and the link owes the remainder (sent before its next use: `Plane.conn`)."""
    rest = _cut(self.segments, self.sent, _ALL)
    self.sent = sum(len(x) for x in self.segments)
    try:
      sent = sockets.send_ready(self.link.sock, rest, _ALL)
    except OSError:
      sent = 0  # (the link is broken: its next use finds it closed)
    self.link.owed = _cut(rest, sent, _ALL) or None


def drop(link: _tcp_link.Link, length: int, watch: Deadline) -> None:
  """Reads and drops the `length` bytes of a frame whose header was read."""
  scratch = memoryview(bytearray(min(length, _CHUNK)))
  while length:
    n = min(length, len(scratch))
    sockets.recv_into(link.sock, scratch[:n], watch)
    length -= n


def broadcast(parts: list[np.ndarray] | None, length: int, source: int, *,
              op: str, timeout: float, source_result: bool = True,
              eager: Eager | None = None) -> np.ndarray | None:
  """Returns the source's `length` bytes on every process (a binomial tree, or a pipelined chain per lane).

  Collective: every process must call this, in the same order, with the
  same `length` and `source`; the source passes its parts (C-contiguous
  arrays, `length` bytes in all), the others None. The source sends from
  the parts themselves; its own result (a packed copy, made piece by piece
  behind the sends) is None with `source_result=False`. Receivers read
  straight into the result.

  A payload of one stripe among 3 processes or more goes down a binomial
  tree (`_tree`). A payload of `STRIPE_BYTES` or more is cut into one stripe per lane
  (`Plane.lanes` connections per pair of processes), each moving down its
  own chain at once: the first on the calling thread, the others on the
  plane's lane threads. One TCP stream is limited by the one core that
  copies its bytes in and out of the kernel; two keep two cores copying
  (bench/README.md). With a started `eager` (the source's), the first
  stripe's frame is already partly sent.
  """
  deadline = time.monotonic() + timeout
  plane = _tcp_link.get_plane(op, deadline)
  call = plane.seq
  rank = (plane.me - source) % plane.count
  out = buffers.take(length) if rank > 0 or source_result else None
  ranges = stripes(length, plane.lanes)
  pieces = [None] * len(ranges) if rank > 0 else _pieces(parts, ranges)
  if len(ranges) == 1 and plane.count > 2:
    _tree(plane, call, source, length, pieces[0], out, op, deadline,
          eager if eager and eager.link else None)
    return out
  jobs = [plane.lane_threads[lane - 1].run(functools.partial(
      _chain, plane, lane, call, source, ranges[lane], pieces[lane], out, op,
      deadline, True)) for lane in range(1, len(ranges))]
  error = None
  try:
    _chain(plane, 0, call, source, ranges[0], pieces[0], out, op, deadline,
           len(ranges) > 1, eager if eager and eager.link else None)
  except errors.MultihostError as e:
    error = e  # The links are closed: the other lanes end within a slice.
  for job in jobs:
    failed = job.wait(deadline + 2 * sockets.SLICE_S)
    error = error or failed
  if error is not None:
    if not isinstance(error, errors.MultihostError):
      raise _failed(plane, None, op, source, error) from error
    raise error
  return out


def _chain(plane: _tcp_link.Plane, lane: int, call: int, source: int,
           stripe: tuple[int, int], piece: list | None,
           out: np.ndarray | None, op: str, deadline: float,
           striped: bool, eager: Eager | None = None) -> None:
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
  sender = None
  if nxt is not None and rank > 0:
    # A stripe of one chunk is read whole before any of it is forwarded:
    # a thread would have no read to overlap, only a handoff to add.
    sender = (sockets.sender(watch, n, plane.sends)
              if lane == 0 and n > _CHUNK else sockets.DirectSender(watch))
  peer = nxt if rank == 0 else prev
  target = None if out is None else out[start:stop]
  try:
    down = plane.conn(nxt, deadline, op, lane) if nxt is not None else None
    if down is not None:
      _start(op, nxt, down, deadline)
    if rank == 0 and eager is not None:
      if down is not eager.link:  # (the links were closed meanwhile)
        raise ConnectionResetError('the link was closed after the agreement')
      _send_and_copy(down, eager.segments, eager.head, target, watch,
                     eager.sent)
    elif rank == 0:
      head = down.frame(call, n)
      _send_and_copy(down, _framed(head, piece, striped), len(head), target,
                     watch)
    else:
      view = memoryview(target)
      if down is not None:
        sender.send(down.sock, down.frame(call, n))
      up = plane.conn(prev, deadline, op, lane)
      _start(op, prev, up, deadline)
      up.read_frame(call, n, op, prev, watch)
      if down is None:  # The end of the chain: one read into the result.
        sockets.recv_into(up.sock, view, watch)
      for at in range(0, n if down is not None else 0, _CHUNK):
        chunk = view[at:at + _CHUNK]
        sockets.recv_into(up.sock, chunk, watch)
        sender.send(down.sock, chunk)
    if sender is not None:
      peer = nxt
      sender, done = None, sender
      done.close(deadline)
  except (OSError, TimeoutError, errors.MultihostError) as e:
    raise _failed(plane, sender, op, peer, e) from e


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


def _tree(plane: _tcp_link.Plane, call: int, source: int, n: int,
          piece: list | None, out: np.ndarray | None, op: str,
          deadline: float, eager: Eager | None) -> None:
  """Moves a payload of one stripe down a binomial tree rooted at the source: ceil(log2 P) hops where the chain takes P - 1.

  Every process but the source reads the whole payload into `out` from
  its parent, then sends it to its children, largest subtree first. The
  source sends `piece` (its parts) to each child, copying into `out` (if
  any) behind its first send; its frame to the next process (rank 1) may
  be its started `eager` one, of which only the rest is sent.
  """
  me, count = plane.me, plane.count
  rank = (me - source) % count
  parent, children = tree_peers(rank, count)
  watch = Deadline(op, deadline, plane.rt.watchdog)
  peer = me
  try:
    if parent is not None:
      peer = (parent + source) % count
      up = plane.conn(peer, deadline, op)
      _start(op, peer, up, deadline)
      up.read_frame(call, n, op, peer, watch)
      sockets.recv_into(up.sock, memoryview(out), watch)
    target = out if parent is None else None  # (the source copies once)
    for child in children:
      peer = (child + source) % count
      down = plane.conn(peer, deadline, op)
      _start(op, peer, down, deadline)
      if parent is not None:
        sockets.send_all(down.sock, down.frame(call, n), watch)
        sockets.send_all(down.sock, memoryview(out), watch)
        continue
      if child == 1 and eager is not None:
        if down is not eager.link:  # (the links were closed meanwhile)
          raise ConnectionResetError('the link was closed after the agreement')
        _send_and_copy(down, eager.segments, eager.head, target, watch,
                       eager.sent)
      else:
        head = down.frame(call, n)
        _send_and_copy(down, segments(head, piece), len(head), target, watch)
      target = None
  except (OSError, TimeoutError, errors.MultihostError) as e:
    raise _failed(plane, None, op, peer, e) from e


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
  sender = sockets.sender(watch, max(sizes), plane.sends)
  try:
    down = plane.conn(nxt, deadline, op)
    up = plane.conn(prev, deadline, op)
    _start(op, nxt, down, deadline)
    _start(op, prev, up, deadline)
    for step in range(count - 1):
      out_block = (me - step) % count
      in_block = (me - step - 1) % count
      sender.send(down.sock, down.frame(call, sizes[out_block]))
      # The first block is this process's own: it goes out from the
      # caller's buffer, and is copied into the result while it does.
      sender.send(down.sock, memoryview(mine if step == 0
                                        else blocks[out_block]))
      if not copied:
        blocks[me][:] = mine
        copied = True
      up.read_frame(call, sizes[in_block], op, prev, watch)
      sockets.recv_into(up.sock, memoryview(blocks[in_block]), watch)
      if sender.error is not None:
        raise sender.error
    if not copied:
      blocks[me][:] = mine
    peer = nxt
    sender, done = None, sender
    done.close(deadline)
  except (OSError, TimeoutError, errors.MultihostError) as e:
    raise _failed(plane, sender, op, peer, e) from e
  return rows


class TcpTransport:
  """The `Transport` over the authenticated TCP links: a pipelined chain per lane for broadcast, a ring for all-gather."""

  name = 'tcp'

  def broadcast(self, parts: list[np.ndarray] | None, length: int,
                source: int, *, op: str, timeout: float,
                source_result: bool = True,
                early: Eager | None = None) -> np.ndarray | None:
    """See `Transport.broadcast`."""
    return broadcast(parts, length, source, op=op, timeout=timeout,
                     source_result=source_result, eager=early)

  def allgather(self, buffer: np.ndarray, sizes: list[int], *, op: str,
                timeout: float) -> np.ndarray:
    """See `Transport.allgather`."""
    return allgather(buffer, sizes, op=op, timeout=timeout)


TCP = TcpTransport()
