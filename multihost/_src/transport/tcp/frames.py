"""Data plane: a TCP link's frames (headers carrying the call, the length and a frame number, MAC'd per direction), and the link that numbers them.

Every frame header after a link's handshake (`transport.tcp.link`) carries a MAC
under the link's key for its direction and a frame number, so injected,
replayed or reordered frames are refused.
"""

from __future__ import annotations

import hashlib
import hmac
import select
import socket
import struct

from multihost._src.runtime import failures
from multihost._src.runtime.deadline import Deadline
from multihost._src.transport.tcp import sockets
from multihost._src.transport.tcp import stage as _stage

_MAC = 16

# A frame header: call id, byte count, frame number on this link and
# direction, then a MAC of those under the link's key for that direction.
# The frame MAC is keyed BLAKE2b (a MAC by design, RFC 7693): every call
# computes a few, and it costs a third of an HMAC-SHA256 of a short message.
_FRAME = struct.Struct('<QQQ')

FRAME_SIZE = _FRAME.size + _MAC

# What a frame header's read also takes when it has come, at most: a small
# frame's body, or the start of the next frame or of a data frame's
# payload. It is kept for the link's next reads (`Link.take`,
# `Link.recv_into`): a small frame is then one system call, not two.
AHEAD = 4096


class Link:
  """An authenticated connection: its socket and a MAC key per direction.

  Every read of a link's bytes goes through `take` or `recv_into`: a read
  may take bytes ahead (`AHEAD`), which the next reads return first.
  """

  __slots__ = ('sock', 'send_key', 'recv_key', 'sent', 'received', 'poll',
               'owed', 'shared', '_send_mac', '_recv_mac', '_ahead', '_at',
               '_end')

  def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes):
    self.sock = sock
    self.send_key = send_key
    self.recv_key = recv_key
    # Keyed once: each frame's MAC copies these (the key's block is
    # compressed once per link, not once per frame).
    self._send_mac = hashlib.blake2b(key=send_key, digest_size=_MAC)
    self._recv_mac = hashlib.blake2b(key=recv_key, digest_size=_MAC)
    self._ahead = bytearray(FRAME_SIZE + AHEAD)
    self._at = 0  # bytes read ahead: _ahead[_at:_end]
    self._end = 0
    self.sent = 0
    self.received = 0
    self.poll = select.poll()  # for `transport.tcp.sockets.open_at_peer`
    self.poll.register(sock, select.POLLIN | select.POLLRDHUP)
    # The rest of a frame a call left half sent after a difference or a
    # timeout (`transport.tcp.eager.Eager.defer`): sent before anything else
    # (`Plane.conn`).
    self.owed: list[memoryview] | None = None
    # The peer's stage, where both sides of a local link passed theirs
    # (`transport.tcp.shared`); else None.
    self.shared: _stage.PeerStage | None = None

  def frame(self, call: int, length: int) -> bytes:
    """The next frame header to send (the caller sends frames in this order)."""
    head = _FRAME.pack(call, length, self.sent)
    self.sent += 1
    mac = self._send_mac.copy()
    mac.update(head)
    return head + mac.digest()

  def read_frame(self, call: int, length: int, op: str, peer: int,
                 deadline: Deadline | None = None) -> None:
    """Reads the next frame header; raises unless it is authentic and expected."""
    self._expect(self.take(FRAME_SIZE, deadline), call, length, op, peer)

  def _expect(self, head: bytes, call: int, length: int, op: str,
              peer: int) -> None:
    """Raises unless frame header `head` is authentic and is `call`'s, of `length` bytes."""
    got = self.check(head, op, peer)
    if got != (call, length):
      raise failures.out_of_step(op, peer, got, (call, length))

  def take(self, n: int, deadline: Deadline | None = None) -> bytes:
    """The link's next `n` bytes; a read for them also takes what else has come, up to `AHEAD` more, for the next reads."""
    at, end = self._at, self._end
    if end - at < n:
      if n > len(self._ahead):
        out = bytearray(n)
        self.recv_into(memoryview(out), deadline)
        return bytes(out)
      if at:  # The bytes left to the buffer's start: room for the rest.
        self._ahead[:end - at] = self._ahead[at:end]
        at, end = 0, end - at
        self._at, self._end = at, end
      view = memoryview(self._ahead)
      while end < n:
        # Kept as they come: a read that times out (the link stays for the
        # next call) leaves every byte that came in its place.
        end += sockets.recv_some(self.sock, [view[end:]], deadline,
                                 idle=not end)
        self._end = end
    taken = bytes(self._ahead[at:at + n])
    at += n
    self._at, self._end = (0, 0) if at == end else (at, end)
    return taken

  def read_frame_into(self, call: int, view: memoryview, op: str, peer: int,
                      deadline: Deadline | None = None) -> None:
    """Reads the next frame, its payload into `view` (`len(view)` bytes); raises unless its header is authentic and expected.

    The header and the payload's start come in one read (a frame is sent
    in one write, `sockets.send_views`), and the header is checked before
    the rest is waited for. Only for a data frame: on an error the
    transfer breaks the links, so bytes read of a frame cut short are not
    kept for a next read (as `take` keeps them).
    """
    head = bytearray(FRAME_SIZE)
    into = memoryview(head)
    got = self._from_ahead(into)
    done = self._from_ahead(view) if got == FRAME_SIZE else 0
    while got < FRAME_SIZE:
      k = sockets.recv_some(self.sock, [into[got:], view], deadline,
                            idle=not got)
      done = max(got + k - FRAME_SIZE, 0)
      got = min(got + k, FRAME_SIZE)
    self._expect(bytes(head), call, len(view), op, peer)
    if done < len(view):
      sockets.recv_into(self.sock, view[done:], deadline)

  def recv_into(self, view: memoryview,
                deadline: Deadline | None = None) -> None:
    """Fills `view` with the link's next bytes: first those read ahead, then from the socket (`sockets.recv_into`)."""
    k = self._from_ahead(view)
    if k < len(view):
      sockets.recv_into(self.sock, view[k:], deadline)

  def _from_ahead(self, view: memoryview) -> int:
    """Copies into `view` what was read ahead, as far as it fills it; the bytes copied."""
    at, end = self._at, self._end
    k = min(end - at, len(view))
    if k:
      view[:k] = self._ahead[at:at + k]
      at += k
      self._at, self._end = (0, 0) if at == end else (at, end)
    return k

  def open_at_peer(self) -> bool:
    """Whether the peer has not closed the link (bytes read ahead, or waiting, count as open: see `sockets.open_at_peer`).

    The common cases are one poll of the link's socket: nothing to read, or
    bytes waiting while the peer has not shut its side (as when its next
    frame came before this call asked); the rest, a peek.
    """
    if self._at < self._end:
      return True
    events = self.poll.poll(0)
    if not events or not events[0][1] & sockets.CLOSING:
      return True
    return sockets.open_at_peer(self.sock)

  def check(self, got: bytes, op: str, peer: int) -> tuple[int, int]:
    """(call, length) of the frame header `got`, the next due; raises unless authentic and in order."""
    head, mac = got[:_FRAME.size], got[_FRAME.size:]
    want = self._recv_mac.copy()
    want.update(head)
    want_mac = want.digest()
    if not hmac.compare_digest(mac, want_mac):
      raise failures.forged_frame(op, peer, 'failed authentication')
    got_call, got_length, number = _FRAME.unpack(head)
    if number != self.received:
      raise failures.forged_frame(
          op, peer, f'is frame {number} where frame {self.received} was due '
          '(a replayed or reordered frame)')
    self.received += 1
    return got_call, got_length

