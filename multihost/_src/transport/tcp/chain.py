"""Data plane: bulk bytes between processes over TCP (the default transport of large payloads).

Why not a device collective: on CPU, JAX's gloo collectives move bytes
several times slower than plain TCP between the same processes (see
bench/README.md). The payloads of `broadcast_one_to_all`,
`process_allgather` and the object collectives are host values (numpy in,
numpy out), so they go host to host: a pipelined chain for broadcast (memory
and source traffic do not grow with the process count), a ring for
all-gather. Set MULTIHOST_TRANSPORT=device to use a device collective
instead (e.g. where peers cannot open TCP connections to each other).

This module holds the two transfer algorithms; the links they run on are
`transport.tcp.link`'s, their socket I/O `transport.tcp.sockets`'s. Every socket wait is bounded by
the collective's timeout; a peer that dies closes its sockets, which raises
here at once.
"""

from __future__ import annotations

import functools
import threading
import time

import numpy as np

from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime.deadline import Deadline
from multihost._src.transport import buffers
from multihost._src.transport.tcp import errors as tcp_errors
from multihost._src.transport.tcp import frames
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
# Set in the call field of a data frame that ends with the source's verdict
# (`Eager`): its length counts the payload and that one byte.
VERDICT_BIT = 1 << 62
# The verdicts: the source completed the agreement (the payload stands);
# it gave the call up (a timeout: every receiver raises); the agreement
# found a difference (receivers skip the frame: if the call goes on, the
# payload follows in a frame of its own).
GO, GAVE_UP, AGAIN = b'\x01', b'\x00', b'\x02'


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
                   already: int = 0, then: bytes = b'') -> None:
  """Sends `segments_` down the chain; with `out`, copies the payload there too.

  The copy goes piece by piece right after each piece is sent, while the
  piece is still in the CPU's cache and the socket buffers keep the next
  process reading: a copy after the whole send would read the leaves from
  memory again and delay the source's return by all of it. The first
  `skip` bytes are the frame header, not payload; the first `already`
  bytes were sent before (`Eager`), and are only copied. `then` is sent
  right behind the last byte, before that byte's piece is copied (the
  next process need not wait for the copies).
  """
  offset = 0
  # (Bytes still to send: only `then` needs them counted.)
  left = (sum(len(memoryview(x).cast('B')) for x in segments_) - already
          if then else 0)
  if then and left <= 0:
    sockets.send_all(down.sock, then, watch)
  for segment in segments_:
    view = memoryview(segment).cast('B')
    for start in range(0, len(view), _CHUNK):
      piece = view[start:start + _CHUNK]
      if already < len(piece):
        sockets.send_all(down.sock, piece[already:], watch)
        left -= len(piece) - already
        already = 0
        if then and left <= 0:
          sockets.send_all(down.sock, then, watch)
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
  the source is before agreeing.

  All or none. A process can complete the agreement while the source does
  not: the source sent all its rounds, then timed out waiting for its last
  one, and a latecomer came before the source's gave-up mark was visible
  (`control.waiting.late`), so every other process completes. Such a process
  goes on to read the transfer; it must not return the payload the source
  sent ahead, since the source raises. So the frame carries one more byte
  after the payload (`VERDICT_BIT`), which is never sent ahead: the
  source's verdict, sent only once its own agreement ended. On agreement
  `broadcast` sends the rest of the frame and `GO`; on a timeout the link
  owes the rest and `GAVE_UP`, on a difference the rest and `AGAIN`
  (`defer`: sent at once as far as the socket takes it, the remainder
  before anything else on that link). Each process in the chain forwards
  the verdict behind the payload, and returns only on `GO`: on `GAVE_UP`
  every one raises (`source_gave_up`), so either every process returns
  the payload or every process raises. A process that did not complete
  the agreement (it raised) leaves the frame on its socket; its next
  agreement drops it (`control.links._receive`), as does a process after a
  difference, unless that call goes on to a transfer: then the frame,
  marked `AGAIN`, is skipped and the payload's own frame read. The data
  frames carry the call's number (`link.transfer_id`), so the next transfer
  is in step on every process whichever of them reached this one. (When
  the process that timed out is not the source, the call's outcome record
  decides: see `control.links`.)
  """

  def __init__(self, parts: list[np.ndarray], length: int):
    self.parts = parts
    self.length = length
    self.link: _tcp_link.Link | None = None  # set once started
    self.segments: list[memoryview] = []
    self.head = 0  # frame header bytes at the start of `segments`
    self.sent = 0

  def start(self, plane: _tcp_link.Plane, link: _tcp_link.Link) -> None:
    """Sends the frame of stripe 0 to `link` (the next process's), up to what its socket takes now, never its verdict."""
    ranges = stripes(self.length, plane.lanes)
    a, b = ranges[0]
    # The data frame the transfer will send: its id is the one every
    # process gives the next transfer, and one byte ends it (the verdict).
    head = link.frame(_tcp_link.transfer_id(plane) | VERDICT_BIT, b - a + 1)
    piece = _pieces(self.parts, ranges)[0]
    self.segments = [memoryview(x).cast('B')
                     for x in _framed(head, piece, len(ranges) > 1)]
    self.head = len(head)
    self.link = link
    self.sent = sockets.send_ready(link.sock, self.segments, EAGER_BYTES)

  def defer(self, verdict: bytes) -> None:
    """Ends the frame with `verdict` (`GAVE_UP` after a timeout, `AGAIN` after a difference), sent at once as far as the socket takes it; the link owes the remainder (sent before its next use: `Plane.conn`)."""
    rest = _cut([*self.segments, memoryview(verdict)], self.sent, _ALL)
    link, self.link = self.link, None
    try:
      sent = sockets.send_ready(link.sock, rest, _ALL)
    except OSError:
      sent = 0  # (the link is broken: its next use finds it closed)
    link.owed = _cut(rest, sent, _ALL) or None


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
  """Returns the source's `length` bytes on every process (a pipelined chain per lane).

  Collective: every process must call this, in the same order, with the
  same `length` and `source`; the source passes its parts (C-contiguous
  arrays, `length` bytes in all), the others None. The source sends from
  the parts themselves; its own result (a packed copy, made piece by piece
  behind the sends) is None with `source_result=False`. Receivers read
  straight into the result.

  A payload of `STRIPE_BYTES` or more is cut into one stripe per lane
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
  gave_up = threading.Event()  # set when the source's verdict said so
  jobs = [plane.lane_threads[lane - 1].run(functools.partial(
      _chain, plane, lane, call, source, ranges[lane], pieces[lane], out, op,
      deadline, True, gave_up=gave_up)) for lane in range(1, len(ranges))]
  error = None
  try:
    error = _chain(plane, 0, call, source, ranges[0], pieces[0], out, op,
                   deadline, len(ranges) > 1,
                   eager if eager and eager.link else None)
    if error is not None:
      # The source gave the call up (`Eager`): it sends no other stripe,
      # and the other lanes stop waiting for one within a slice, their
      # links untouched (nothing of this call is on them).
      gave_up.set()
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
           striped: bool, eager: Eager | None = None, *,
           gave_up: threading.Event | None = None
           ) -> errors.CollectiveTimeoutError | None:
  """Moves bytes `stripe` of the payload down the chain on `lane`.

  The source sends `piece` (its parts when the payload is one stripe, else
  views of its bytes of the stripe, `striped`); every other process reads into
  `out[start:stop]` and forwards down the chain. Returns the error to raise
  when the source's verdict says it gave the call up (`Eager`), its frame
  read whole (the links stay in step). A lane past the first stops waiting
  for its frame once `gave_up` is set (`_Stopped`).
  """
  me, count = plane.me, plane.count
  start, stop = stripe
  n = stop - start
  rank = (me - source) % count
  prev = (me - 1) % count
  nxt = (me + 1) % count if rank < count - 1 else None
  watch = Deadline(op, deadline, plane.rt.watchdog)
  if gave_up is not None:
    watch.idle = functools.partial(_unless_stopped, watch, gave_up)
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
      # The rest of the frame, and GO: this process completed the agreement.
      _send_and_copy(down, eager.segments, eager.head, target, watch,
                     eager.sent, then=GO)
    elif rank == 0:
      head = down.frame(call, n)
      _send_and_copy(down, _framed(head, piece, striped), len(head), target,
                     watch)
    else:
      view = memoryview(target)
      up = plane.conn(prev, deadline, op, lane)
      _start(op, prev, up, deadline)
      while True:
        # A frame the source sent during the agreement ends with its
        # verdict (`Eager`); it is forwarded as it came.
        ends = _read_head(up, call, n, op, prev, watch)
        if down is not None:
          sender.send(down.sock, down.frame(call | VERDICT_BIT if ends
                                            else call, n + ends))
        if down is None:  # The end of the chain: one read into the result.
          sockets.recv_into(up.sock, view, watch)
        for at in range(0, n if down is not None else 0, _CHUNK):
          chunk = view[at:at + _CHUNK]
          sockets.recv_into(up.sock, chunk, watch)
          sender.send(down.sock, chunk)
        if not ends:
          break
        verdict = sockets.recv_exact(up.sock, 1, watch)
        if down is not None:
          sender.send(down.sock, verdict)
        if verdict == GO:
          break
        if verdict == GAVE_UP:
          if sender is not None:  # The next process raises too.
            sender, done = None, sender
            done.close(deadline)
          return failures.source_gave_up(op, source)
        if verdict != AGAIN:  # (AGAIN: the payload's own frame follows)
          raise failures.forged_frame(op, prev,
                                      f'ended with verdict {verdict!r}')
    if sender is not None:
      peer = nxt
      sender, done = None, sender
      done.close(deadline)
  except (OSError, TimeoutError, errors.MultihostError) as e:
    raise _failed(plane, sender, op, peer, e) from e
  return None


class _Stopped(Exception):
  """A lane's wait for its frame, stopped: the source gave the call up (`Eager`)."""


def _unless_stopped(watch: Deadline, gave_up: threading.Event) -> None:
  """A lane's `Deadline.idle` (between the slices of a read that received nothing): the plain checks, and `_Stopped` once `gave_up` is set."""
  if gave_up.is_set():
    raise _Stopped()
  watch.check()
  if watch.expired():
    raise TimeoutError('timed out')


def _read_head(up: _tcp_link.Link, call: int, n: int, op: str, peer: int,
               watch: Deadline) -> int:
  """Reads the next data frame's header, of `n` bytes of `call`: 1 when a verdict byte follows them (`Eager`), else 0."""
  got = up.check(sockets.recv_exact(up.sock, frames.FRAME_SIZE, watch), op,
                 peer)
  if got == (call, n):
    return 0
  if got == (call | VERDICT_BIT, n + 1):
    return 1
  raise failures.out_of_step(op, peer, got, (call, n))


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
