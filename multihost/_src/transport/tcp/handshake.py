"""Data plane: a link's handshake, both halves, and the acceptor that admits strangers' connections only within bounds.

The lower-numbered process of a pair connects (`connect`); the other
accepts (`Acceptor`). hello = magic, connector, acceptor, lane, the
connector's nonce; the acceptor answers its nonce and its proof; the
connector answers its proof; the acceptor answers one byte (accepted).
Both proofs are HMACs under the job secret (`transport.tcp.auth`) binding
the job, the pair, both nonces and the lane (`_nonces`), so a relay cannot
swap two lanes' connections, and the link's frame keys follow from them.

Strangers who reach a listener cannot hold it: each handshake has one
deadline (`HANDSHAKE_S`) for all of its bytes, at most `PER_SOURCE`
handshakes from one source address and `MAX_HANDSHAKES` in all are pending,
and a new connection past either limit cuts the oldest pending one (a
peer's handshake takes a round trip, a stranger's lasts to its deadline).
"""

from __future__ import annotations

import collections.abc
import errno
import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time

from multihost._src.runtime import errors
from multihost._src.runtime import settings
from multihost._src.transport.tcp import auth
from multihost._src.transport.tcp import frames
from multihost._src.transport.tcp import local as _local
from multihost._src.transport.tcp import sockets
from multihost._src.transport.tcp import stage as _stage

_HELLO = struct.Struct('<4sIIB16s')
_MAGIC = b'MHT4'
_NONCE = 16
_ACCEPTED = b'\x01'
_PROOF = hashlib.sha256().digest_size

HANDSHAKE_S = 5.0  # an accepted connection must authenticate within this
MAX_HANDSHAKES = 32  # pending at once; a new one closes the oldest
PER_SOURCE = 8  # pending at once from one address; likewise


def _nonces(connector: bytes, acceptor: bytes, lane: int) -> bytes:
  """What a handshake's proofs and frame keys bind: both nonces and the lane."""
  return connector + acceptor + bytes([lane])


def connect(conn: socket.socket, *, me: int, peer: int, lane: int,
            job: bytes, secret: bytes, where: str, prefix: str,
            stage: _stage.Stage | None = None) -> frames.Link:
  """The connector's half on the open `conn` to the higher-numbered `peer`: the link, once both sides proved the job secret.

  On a local link (lane 0) both sides then pass their `stage`
  (`tcp.stage.exchange`): the link's `shared` is the peer's.

  Raises:
    MultihostError: the listener at `where` did not prove the secret, did
      not accept, or passed a descriptor that is not a stage (the message
      says what to check).
    OSError: the connection failed or was cut.
  """
  nonce = secrets.token_bytes(_NONCE)
  conn.sendall(_HELLO.pack(_MAGIC, me, peer, lane, nonce))
  reply = sockets.recv_exact(conn, _NONCE + _PROOF)
  nonces = _nonces(nonce, reply[:_NONCE], lane)
  if not hmac.compare_digest(reply[_NONCE:], auth.proof(
      secret, b'accept', job, me, peer, nonces)):
    raise errors.MultihostError(
        f'{prefix} the listener at {where} (published as process {peer}\'s) '
        f'did not prove the job secret: it is not process {peer} of this '
        'job. Check that every process has the same job secret and that '
        'nothing else took the address.')
  conn.sendall(auth.proof(secret, b'connect', job, me, peer, nonces))
  if sockets.recv_exact(conn, 1) != _ACCEPTED:
    raise errors.MultihostError(
        f'{prefix} process {peer} at {where} did not accept the handshake.')
  sockets.tune(conn)
  link = frames.Link(conn, *auth.link_keys(secret, job, me, peer, nonces,
                                           connector=True))
  try:
    link.shared = _peer_stage(conn, lane, stage)
  except ValueError as e:
    raise errors.MultihostError(
        f'{prefix} process {peer} at {where} did not pass a stage: {e}.'
    ) from e
  return link


def _peer_stage(conn: socket.socket, lane: int,
                stage: _stage.Stage | None) -> _stage.PeerStage | None:
  """A link's `shared`: on a local link's lane 0 both sides pass their stage (`tcp.stage.exchange`) and this is the peer's; else None.

  Raises:
    OSError, ValueError: as `tcp.stage.exchange`.
  """
  if conn.family != socket.AF_UNIX or lane != 0:
    return None
  return _stage.exchange(conn, stage)


class Acceptor:
  """The accepting half: takes connections on listeners, admits them within the limits, and hands each link a lower-numbered peer proved to `on_link(peer, lane, link)`, under `lock`."""

  def __init__(self, *, me: int, job: bytes, secret: bytes,
               lock: threading.Condition,
               on_link: collections.abc.Callable[[int, int, frames.Link],
                                                 None],
               stage: _stage.Stage | None = None):
    self.me = me
    self.stage = stage  # passed to local peers (`tcp.stage.exchange`)
    self.job = job
    self.secret = secret
    self.lock = lock
    self.on_link = on_link
    # Accepted connections still in their handshake, oldest first:
    # connection -> its source address.
    self.pending: dict[socket.socket, str] = {}

  def serve(self, listener: socket.socket) -> None:
    """Accepts connections on `listener` until it is closed; each handshake runs on its own thread."""
    while True:
      try:
        conn, source = listener.accept()
      except OSError as e:
        if e.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):
          return  # the listener was closed
        # Out of file descriptors or memory, or a connection aborted before
        # it was accepted: back off and keep listening.
        time.sleep(0.05 if e.errno in (errno.EMFILE, errno.ENFILE,
                                       errno.ENOBUFS, errno.ENOMEM) else 0.001)
        continue
      self._admit(conn, _local.source(conn, source))
      try:
        threading.Thread(target=self._handshake, args=(conn,), daemon=True,
                         name='multihost-transport-handshake').start()
      except RuntimeError:
        self._settled(conn)
        sockets.close(conn)

  def _admit(self, conn: socket.socket, source: str) -> None:
    """Counts `conn` as pending; past a limit, cuts the oldest pending one."""
    with self.lock:
      same = [c for c, s in self.pending.items() if s == source]
      oldest = None
      if len(same) >= PER_SOURCE:
        oldest = same[0]
      elif len(self.pending) >= MAX_HANDSHAKES:
        oldest = next(iter(self.pending))
      if oldest is not None:
        del self.pending[oldest]
        try:  # Wakes its handshake thread, which closes it.
          oldest.shutdown(socket.SHUT_RDWR)
        except OSError:
          pass
      self.pending[conn] = source

  def _settled(self, conn: socket.socket) -> None:
    with self.lock:
      self.pending.pop(conn, None)

  def _handshake(self, conn: socket.socket) -> None:
    """Authenticates a connecting peer; keeps the connection only if it proves itself."""
    keep = False
    deadline = time.monotonic() + HANDSHAKE_S  # for all of its bytes
    try:
      magic, peer, target, lane, nonce = _HELLO.unpack(
          sockets.recv_by(conn, _HELLO.size, deadline))
      if (magic != _MAGIC or target != self.me or not 0 <= peer < self.me
          or lane >= settings.MAX_TCP_LANES):
        return
      mine = secrets.token_bytes(_NONCE)
      nonces = _nonces(nonce, mine, lane)
      conn.settimeout(max(deadline - time.monotonic(), 0.001))
      conn.sendall(mine + auth.proof(self.secret, b'accept', self.job, peer,
                                     self.me, nonces))
      theirs = sockets.recv_by(conn, _PROOF, deadline)
      if not hmac.compare_digest(theirs, auth.proof(
          self.secret, b'connect', self.job, peer, self.me, nonces)):
        return
      with self.lock:
        if self.pending.pop(conn, None) is None:
          return  # cut as the oldest pending one meanwhile
        conn.sendall(_ACCEPTED)
      sockets.tune(conn)
      link = frames.Link(conn, *auth.link_keys(
          self.secret, self.job, peer, self.me, nonces, connector=False))
      link.shared = _peer_stage(conn, lane, self.stage)  # (within deadline)
      with self.lock:
        self.on_link(peer, lane, link)
        keep = True
    except (OSError, struct.error, ValueError):
      pass
    finally:
      self._settled(conn)
      if not keep:
        sockets.close(conn)
