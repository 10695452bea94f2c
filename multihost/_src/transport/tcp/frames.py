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

_MAC = 16

# A frame header: call id, byte count, frame number on this link and
# direction, then a MAC of those under the link's key for that direction.
# The frame MAC is keyed BLAKE2b (a MAC by design, RFC 7693): every call
# computes a few, and it costs a third of an HMAC-SHA256 of a short message.
_FRAME = struct.Struct('<QQQ')

FRAME_SIZE = _FRAME.size + _MAC


def _frame_mac(key: bytes, head: bytes) -> bytes:
  return hashlib.blake2b(head, key=key, digest_size=_MAC).digest()


class Link:
  """An authenticated connection: its socket and a MAC key per direction."""

  __slots__ = ('sock', 'send_key', 'recv_key', 'sent', 'received', 'poll',
               'owed')

  def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes):
    self.sock = sock
    self.send_key = send_key
    self.recv_key = recv_key
    self.sent = 0
    self.received = 0
    self.poll = select.poll()  # for `transport.tcp.sockets.open_at_peer`
    self.poll.register(sock, select.POLLIN | select.POLLRDHUP)
    # The rest of a frame a call left half sent after a difference or a
    # timeout (`transport.tcp.eager.Eager.defer`): sent before anything else
    # (`Plane.conn`).
    self.owed: list[memoryview] | None = None

  def frame(self, call: int, length: int) -> bytes:
    """The next frame header to send (the caller sends frames in this order)."""
    head = _FRAME.pack(call, length, self.sent)
    self.sent += 1
    return head + _frame_mac(self.send_key, head)

  def read_frame(self, call: int, length: int, op: str, peer: int,
                 deadline: Deadline | None = None) -> None:
    """Reads the next frame header; raises unless it is authentic and expected."""
    got = self.check(sockets.recv_exact(self.sock, FRAME_SIZE, deadline), op,
                     peer)
    if got != (call, length):
      raise failures.out_of_step(op, peer, got, (call, length))

  def check(self, got: bytes, op: str, peer: int) -> tuple[int, int]:
    """(call, length) of the frame header `got`, the next due; raises unless authentic and in order."""
    head, mac = got[:_FRAME.size], got[_FRAME.size:]
    want_mac = _frame_mac(self.recv_key, head)
    if not hmac.compare_digest(mac, want_mac):
      raise failures.forged_frame(op, peer, 'failed authentication')
    got_call, got_length, number = _FRAME.unpack(head)
    if number != self.received:
      raise failures.forged_frame(
          op, peer, f'is frame {number} where frame {self.received} was due '
          '(a replayed or reordered frame)')
    self.received += 1
    return got_call, got_length

