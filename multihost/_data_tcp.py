"""Data plane: bulk bytes between processes over TCP (the default transport of large payloads).

Why not a device collective: on CPU, JAX's gloo collectives move about
0.5 GB/s per process here (a 64 MiB broadcast takes ~135 ms), while plain
loopback TCP moves 4.5-6 GB/s. The payloads of `broadcast_one_to_all`,
`process_allgather` and the object collectives are host values (numpy in,
numpy out), so they go host to host: a pipelined chain for broadcast (memory
and source traffic do not grow with the process count), a ring for
all-gather. Set MULTIHOST_TRANSPORT=device to use a device collective
instead (e.g. where peers cannot open TCP connections to each other).

Connections are opened on first use: every process listens on an ephemeral
port of the interface that reaches the coordinator, publishes its address in
the coordination service's key-value store, and the lower-numbered process
of each pair connects. Every socket wait is bounded by the collective's
timeout; a peer that dies closes its sockets, which raises here at once.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import queue
import secrets
import socket
import struct
import threading
import time

import numpy as np

from multihost import _coordination
from multihost import _diagnostics
from multihost import _errors
from multihost import _process
from multihost import _secret
from multihost import _watchdog

_CHUNK = 4 << 20
_ADDRESS_KEY = 'multihost_transport/{}'
# Handshake (the lower index connects): hello = magic, connector, acceptor,
# connector's nonce; the acceptor answers its nonce and its proof; the
# connector answers its proof; the acceptor answers one byte (accepted).
_HELLO = struct.Struct('<4sII16s')
_MAGIC = b'MHT2'
_NONCE = 16
_MAC = 16
_ACCEPTED = b'\x01'
_HANDSHAKE_S = 5.0  # an accepted connection must authenticate within this
_MAX_HANDSHAKES = 32  # concurrent; more pending connections are closed
# A frame header: call id, byte count, frame number on this link and
# direction, then a MAC of those under the link's key for that direction.
_FRAME = struct.Struct('<QQQ')
_FRAME_SIZE = _FRAME.size + _MAC


def _proof(secret: bytes, label: bytes, job: bytes, low: int, high: int,
           nonces: bytes) -> bytes:
  message = label + job + struct.pack('<II', low, high) + nonces
  return hmac.digest(secret, message, hashlib.sha256)


class _Link:
  """An authenticated connection: its socket and a MAC key per direction."""

  __slots__ = ('sock', 'send_key', 'recv_key', 'sent', 'received')

  def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes):
    self.sock = sock
    self.send_key = send_key
    self.recv_key = recv_key
    self.sent = 0
    self.received = 0

  def frame(self, call: int, length: int) -> bytes:
    """The next frame header to send (the caller sends frames in this order)."""
    head = _FRAME.pack(call, length, self.sent)
    self.sent += 1
    return head + hmac.digest(self.send_key, head, hashlib.sha256)[:_MAC]

  def read_frame(self, call: int, length: int, op: str, peer: int,
                 watch: tuple[str, float] | None = None) -> None:
    """Reads the next frame header; raises unless it is authentic and expected."""
    got = _recv_exact(self.sock, _FRAME_SIZE, watch)
    head, mac = got[:_FRAME.size], got[_FRAME.size:]
    want_mac = hmac.digest(self.recv_key, head, hashlib.sha256)[:_MAC]
    if not hmac.compare_digest(mac, want_mac):
      raise _diagnostics.forged_frame(op, peer, 'failed authentication')
    got_call, got_length, number = _FRAME.unpack(head)
    if number != self.received:
      raise _diagnostics.forged_frame(
          op, peer, f'is frame {number} where frame {self.received} was due '
          '(a replayed or reordered frame)')
    self.received += 1
    if (got_call, got_length) != (call, length):
      raise _diagnostics.out_of_step(op, peer, (got_call, got_length),
                                     (call, length))


# Socket waits of a transfer are sliced: between slices the failure watchdog
# is checked, so a peer cut off or frozen (its socket silent, not closed)
# raises ProcessFailureError once the watchdog names it.
_SLICE_S = 0.25


class _Plane:
  """This process's listener and its connections to peers."""

  def __init__(self, timeout: float, op: str):
    self.me = _process.process_index()
    self.count = _process.process_count()
    self.job, self.secret = _secret.job_keys(timeout, op)
    self.seq = 0  # Transfers so far: every process counts the same ones.
    self.broken: str | None = None
    self.lock = threading.Condition()
    self.conns: dict[int, _Link] = {}
    self.handshakes = threading.BoundedSemaphore(_MAX_HANDSHAKES)
    host = _local_host()
    self.listener = socket.socket(_family(host), socket.SOCK_STREAM)
    self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self.listener.bind((host, 0))
    # The kernel's largest backlog: a port scan of a few hundred connections
    # must not fill the accept queue, where the SYN of a peer's real connect
    # would be dropped and sent again only a second later.
    self.listener.listen(socket.SOMAXCONN)
    port = self.listener.getsockname()[1]
    threading.Thread(target=self._accept, name='multihost-transport',
                     daemon=True).start()
    _coordination.kv_set(_ADDRESS_KEY.format(self.me),
                         f'{host}|{port}'.encode())

  def _accept(self) -> None:
    """Accepts connections for ever; each handshake runs on its own thread."""
    while True:
      try:
        conn, _ = self.listener.accept()
      except OSError as e:
        if e.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):
          return  # the listener was closed
        # Out of file descriptors or memory, or a connection aborted before
        # it was accepted: back off and keep listening.
        time.sleep(0.05 if e.errno in (errno.EMFILE, errno.ENFILE,
                                       errno.ENOBUFS, errno.ENOMEM) else 0.001)
        continue
      if not self.handshakes.acquire(blocking=False):
        _close(conn)
        continue
      try:
        threading.Thread(target=self._handshake, args=(conn,), daemon=True,
                         name='multihost-transport-handshake').start()
      except RuntimeError:
        self.handshakes.release()
        _close(conn)

  def _handshake(self, conn: socket.socket) -> None:
    """Authenticates a connecting peer; keeps the connection only if it proves itself."""
    keep = False
    try:
      conn.settimeout(_HANDSHAKE_S)
      magic, peer, target, nonce = _HELLO.unpack(
          _recv_exact(conn, _HELLO.size))
      if (magic != _MAGIC or target != self.me or not 0 <= peer < self.me or
          peer in self.conns):
        return
      mine = secrets.token_bytes(_NONCE)
      nonces = nonce + mine
      conn.sendall(mine + _proof(self.secret, b'accept', self.job, peer,
                                 self.me, nonces))
      theirs = _recv_exact(conn, hashlib.sha256().digest_size)
      if not hmac.compare_digest(theirs, _proof(
          self.secret, b'connect', self.job, peer, self.me, nonces)):
        return
      with self.lock:
        if peer in self.conns:
          return  # the first valid connection wins
        conn.sendall(_ACCEPTED)
        _tune(conn)
        self.conns[peer] = _Link(
            conn, *_link_keys(self.secret, self.job, peer, self.me, nonces,
                              connector=False))
        keep = True
        self.lock.notify_all()
    except (OSError, struct.error, ValueError):
      pass
    finally:
      self.handshakes.release()
      if not keep:
        _close(conn)

  def _connect(self, peer: int, remaining: float, op: str) -> _Link:
    """Opens and authenticates a connection to the higher-numbered `peer`."""
    start = time.monotonic()
    value = _coordination.kv_get(_ADDRESS_KEY.format(peer), remaining)
    host, port = value.decode().rsplit('|', 1)
    remaining = max(remaining - (time.monotonic() - start), 0.001)
    try:
      conn = socket.create_connection((host, int(port)), timeout=remaining)
    except OSError as e:
      raise _unreachable(op, peer, f'{host}:{port}', e) from e
    try:
      nonce = secrets.token_bytes(_NONCE)
      conn.sendall(_HELLO.pack(_MAGIC, self.me, peer, nonce))
      reply = _recv_exact(conn, _NONCE + hashlib.sha256().digest_size)
      nonces = nonce + reply[:_NONCE]
      if not hmac.compare_digest(reply[_NONCE:], _proof(
          self.secret, b'accept', self.job, self.me, peer, nonces)):
        raise _errors.MultihostError(
            f'{_diagnostics.prefix()} the listener at {host}:{port} (published '
            f'as process {peer}\'s) did not prove the job secret: it is not '
            f'process {peer} of this job. Check that every process has the '
            'same job secret and that nothing else took the address.')
      conn.sendall(_proof(self.secret, b'connect', self.job, self.me, peer,
                          nonces))
      if _recv_exact(conn, 1) != _ACCEPTED:
        raise ConnectionResetError('the peer refused the handshake')
    except BaseException:
      _close(conn)
      raise
    _tune(conn)
    return _Link(conn, *_link_keys(self.secret, self.job, self.me, peer,
                                   nonces, connector=True))

  def conn(self, peer: int, deadline: float, op: str) -> _Link:
    with self.lock:
      if peer in self.conns:
        return self.conns[peer]
    if self.me < peer:
      remaining = max(deadline - time.monotonic(), 0.001)
      try:
        link = self._connect(peer, remaining, op)
      except _errors.MultihostError:
        raise
      except (OSError, TimeoutError) as e:
        raise _peer_error(op, peer, e) from e
      except Exception as e:  # noqa: BLE001
        raise _peer_error(op, peer, e, waiting=True) from e
      with self.lock:
        self.conns[peer] = link
      return link
    with self.lock:
      while peer not in self.conns:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          raise _diagnostics.connect_timeout(op, peer, None)
        self.lock.wait(min(remaining, 0.5))
        _watchdog.check(op)
      return self.conns[peer]


def _link_keys(secret: bytes, job: bytes, low: int, high: int, nonces: bytes,
               *, connector: bool) -> tuple[bytes, bytes]:
  """(send key, receive key) of a link, one key per direction."""
  up = _proof(secret, b'frames low->high', job, low, high, nonces)
  down = _proof(secret, b'frames high->low', job, low, high, nonces)
  return (up, down) if connector else (down, up)


def _close(conn: socket.socket) -> None:
  try:
    conn.close()
  except OSError:
    pass


_plane: _Plane | None = None
_plane_lock = threading.Lock()


def _get_plane(op: str, deadline: float) -> _Plane:
  """The plane, with the sequence number of this transfer advanced."""
  global _plane
  with _plane_lock:
    if _plane is None:
      try:
        _plane = _Plane(max(deadline - time.monotonic(), 0.001), op)
      except _errors.MultihostError:
        raise
      except Exception as e:  # noqa: BLE001
        raise _diagnostics.transfer_timeout(op, 0, 'to publish the job id') from e
  if _plane.broken:
    raise _diagnostics.plane_broken(op, _plane.broken)
  _plane.seq += 1
  return _plane


def _break(plane: _Plane, error: BaseException) -> None:
  """Closes every connection: bytes of a failed transfer may be in flight."""
  plane.broken = f'{type(error).__name__}: {error}'
  with plane.lock:
    for link in plane.conns.values():
      _close(link.sock)


def _local_host() -> str:
  """The address of the interface that reaches the coordinator."""
  address = _coordination.coordinator_address() or '127.0.0.1:0'
  host = address.rsplit(':', 1)[0].strip('[]')
  try:
    probe = socket.socket(_family(host), socket.SOCK_DGRAM)
    probe.connect((host, 9))
    return probe.getsockname()[0]
  except OSError:
    return '127.0.0.1'


def _family(host: str) -> int:
  return socket.AF_INET6 if ':' in host else socket.AF_INET


def _tune(conn: socket.socket) -> None:
  conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
    try:
      conn.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
    except OSError:
      pass


def _recv_exact(conn: socket.socket, n: int,
                watch: tuple[str, float] | None = None) -> bytes:
  buf = bytearray(n)
  _recv_into(conn, memoryview(buf), watch)
  return bytes(buf)


def _recv_into(conn: socket.socket, view: memoryview,
               watch: tuple[str, float] | None = None) -> None:
  """Fills `view`; with `watch=(op, deadline)`, in watched slices (`_watched`)."""
  got = 0
  while got < len(view):
    k = _watched(conn.recv_into, view[got:], watch)
    if k == 0:
      raise ConnectionResetError('the peer closed the connection')
    got += k


def _send_all(conn: socket.socket, view, watch: tuple[str, float]) -> None:
  """Sends all of `view` in watched slices (unlike `sendall`, resumable)."""
  view = memoryview(view).cast('B')
  sent = 0
  while sent < len(view):
    sent += _watched(conn.send, view[sent:], watch)


def _watched(io, view, watch: tuple[str, float] | None) -> int:
  """`io(view)`, retried after each socket-timeout slice until `watch`'s deadline.

  Between slices, raises `ProcessFailureError` once the watchdog knows a
  peer is gone, and `socket.timeout` at the deadline. (A timed-out send or
  recv moved no bytes, so retrying it is safe.)
  """
  if watch is None:
    return io(view)
  op, deadline = watch
  while True:
    try:
      return io(view)
    except socket.timeout:
      _watchdog.check(op)
      if time.monotonic() >= deadline:
        raise


class _Sender:
  """Sends (socket, frame, view) jobs in order on a background thread."""

  def __init__(self, watch: tuple[str, float]):
    self.watch = watch
    self.jobs: queue.SimpleQueue = queue.SimpleQueue()
    self.error: BaseException | None = None
    self.thread = threading.Thread(target=self._run, daemon=True,
                                   name='multihost-transport-send')
    self.thread.start()

  def _run(self) -> None:
    while True:
      job = self.jobs.get()
      if job is None:
        return
      conn, view = job
      if self.error is None:
        try:
          _send_all(conn, view, self.watch)
        except BaseException as e:  # noqa: BLE001
          self.error = e

  def send(self, conn, view) -> None:
    self.jobs.put((conn, view))

  def finish(self, deadline: float) -> BaseException | None:
    self.jobs.put(None)
    self.thread.join(max(deadline - time.monotonic(), 0.001))
    if self.thread.is_alive():
      return TimeoutError('sending did not finish in time')
    return self.error

  def close(self, deadline: float) -> None:
    """Waits for the queued sends; raises what sending raised."""
    error = self.finish(deadline)
    if error is not None:
      raise error


class _DirectSender:
  """`_Sender`'s interface, sending on the calling thread.

  For messages that fit in any socket buffer (`_DIRECT_BYTES`): a send then
  never waits for the peer to read, so a ring of processes that all send
  before they receive cannot deadlock, and no thread is started per call.
  """

  def __init__(self, watch: tuple[str, float]):
    self.watch = watch
    self.error: BaseException | None = None

  def send(self, conn, view) -> None:
    _send_all(conn, view, self.watch)

  def finish(self, deadline: float) -> BaseException | None:
    del deadline
    return None

  def close(self, deadline: float) -> None:
    del deadline


# At most this many payload bytes per message are sent on the calling thread:
# with the frame header they fit in the smallest default socket buffers
# (tcp_wmem/tcp_rmem start at 16 KiB and 128 KiB), even where raising the
# buffers (`_tune`) was refused.
_DIRECT_BYTES = 8 << 10


def _sender(watch: tuple[str, float], largest: int) -> _Sender | _DirectSender:
  return (_DirectSender(watch) if largest <= _DIRECT_BYTES
          else _Sender(watch))


def _failed(plane: _Plane, sender: _Sender | _DirectSender | None, op: str,
            peer: int, error: BaseException) -> _errors.MultihostError:
  """Stops a failed transfer; returns the named error to raise."""
  if sender is not None:
    sender.finish(time.monotonic() + 0.1)
  _break(plane, error)
  return _peer_error(op, peer, error)


def _start(op: str, peer: int, link: _Link, deadline: float) -> None:
  link.sock.settimeout(max(min(deadline - time.monotonic(), _SLICE_S), 0.001))


def broadcast(buffer: np.ndarray | None, length: int, source: int, *,
              op: str, timeout: float) -> np.ndarray:
  """Returns the source's `length` bytes on every process (a pipelined chain).

  Collective: every process must call this, in the same order, with the
  same `length` and `source`.
  """
  deadline = time.monotonic() + timeout
  plane = _get_plane(op, deadline)
  me, count = plane.me, plane.count
  call = plane.seq
  rank = (me - source) % count
  prev = (me - 1) % count
  nxt = (me + 1) % count if rank < count - 1 else None
  out = buffer if rank == 0 else np.empty(length, np.uint8)
  view = memoryview(out.reshape(-1)[:length])
  watch = (op, deadline)
  sender = _sender(watch, length) if nxt is not None else None
  peer = prev
  try:
    down = plane.conn(nxt, deadline, op) if nxt is not None else None
    if down is not None:
      _start(op, nxt, down, deadline)
      sender.send(down.sock, down.frame(call, length))
    if rank == 0:
      sender.send(down.sock, view)
    else:
      up = plane.conn(prev, deadline, op)
      _start(op, prev, up, deadline)
      up.read_frame(call, length, op, prev, watch)
      for start in range(0, length, _CHUNK):
        chunk = view[start:start + _CHUNK]
        _recv_into(up.sock, chunk, watch)
        if sender is not None:
          sender.send(down.sock, chunk)
    if sender is not None:
      peer = nxt
      sender, done = None, sender
      done.close(deadline)
  except (OSError, TimeoutError, _errors.MultihostError) as e:
    raise _failed(plane, sender, op, peer, e) from e
  return out.reshape(-1)[:length]


def allgather(buffer: np.ndarray, sizes: list[int], *, op: str,
              timeout: float) -> np.ndarray:
  """Every process's bytes, as rows: process p's are rows[p, :sizes[p]] (a ring).

  Collective: every process must call this, in the same order, with the
  same `sizes`.
  """
  deadline = time.monotonic() + timeout
  plane = _get_plane(op, deadline)
  me, count = plane.me, plane.count
  call = plane.seq
  prev, nxt = (me - 1) % count, (me + 1) % count
  rows = np.empty((count, max(sizes)), np.uint8)
  rows[me, :sizes[me]] = buffer.reshape(-1)[:sizes[me]]
  blocks = [rows[p, :n] for p, n in enumerate(sizes)]
  peer = prev
  watch = (op, deadline)
  sender = _sender(watch, max(sizes))
  try:
    down = plane.conn(nxt, deadline, op)
    up = plane.conn(prev, deadline, op)
    _start(op, nxt, down, deadline)
    _start(op, prev, up, deadline)
    for step in range(count - 1):
      out_block = (me - step) % count
      in_block = (me - step - 1) % count
      sender.send(down.sock, down.frame(call, sizes[out_block]))
      sender.send(down.sock, memoryview(blocks[out_block]))
      up.read_frame(call, sizes[in_block], op, prev, watch)
      _recv_into(up.sock, memoryview(blocks[in_block]), watch)
      if sender.error is not None:
        raise sender.error
    peer = nxt
    sender, done = None, sender
    done.close(deadline)
  except (OSError, TimeoutError, _errors.MultihostError) as e:
    raise _failed(plane, sender, op, peer, e) from e
  return rows


def _unreachable(op: str, peer: int, address: str,
                 error: OSError) -> _errors.MultihostError:
  """A named error for a connection to `peer` that could not be opened."""
  if isinstance(error, (socket.timeout, TimeoutError)):
    return _diagnostics.connect_timeout(op, peer, address)
  dead = list(_watchdog.failed_within_bound())
  if dead:  # refused because the peer is gone
    return _diagnostics.connection_failure(op, peer, error, dead)
  return _diagnostics.cannot_connect(op, peer, address, error)


def _peer_error(op: str, peer: int, error: BaseException,
                waiting: bool = False) -> _errors.MultihostError:
  """A named error for a failed transfer with `peer`."""
  if isinstance(error, _errors.MultihostError):
    return error
  if isinstance(error, (socket.timeout, TimeoutError)) or waiting:
    return _diagnostics.transfer_timeout(op, peer,
                                         'to send or receive its part')
  # The watchdog names the dead process within its bound; wait for it.
  dead = list(_watchdog.failed_within_bound())
  if not dead and _watchdog.is_running():  # every process is alive
    return _diagnostics.connection_cut(op, peer, error)
  return _diagnostics.connection_failure(op, peer, error, dead or [peer])
