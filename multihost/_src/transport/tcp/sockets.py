"""Data plane: socket I/O of the TCP transport (exact reads, resumable sends, watched slices).

Every socket wait of a transfer is sliced (`SLICE_S`): between slices the
failure watchdog is checked, so a peer cut off or frozen (its socket
silent, not closed) raises `ProcessFailureError` once the watchdog names it.
"""

from __future__ import annotations

import os
import select
import socket
import time

from multihost import env
from multihost._src.runtime import settings
from multihost._src.runtime.deadline import Deadline

# The longest a link's socket waits in one read or write: between slices
# the failure watchdog is checked, so a peer cut off or frozen (its socket
# silent, not closed) raises ProcessFailureError once the watchdog names it.
SLICE_S = 0.25


def close(conn: socket.socket) -> None:
  try:
    conn.close()
  except OSError:
    pass


def family(host: str) -> int:
  return socket.AF_INET6 if ':' in host else socket.AF_INET


# A local link's send buffer (the kernel doubles it, up to
# net.core.wmem_max): see `tune`.
LOCAL_SEND_BUFFER = 4 << 20
# A read of at least LOWAT_FROM bytes over TCP asks the kernel to wake it
# only once LOWAT_BYTES have come (SO_RCVLOWAT; less for the last bytes),
# not at each segment: fewer wake-ups of a reader that shares its core
# (paired, 64 MiB broadcasts over TCP links took 8-14% less; 1 MiB ones
# moved within the noise, so they read as before). See `recv_into`.
LOWAT_FROM = 2 << 20
LOWAT_BYTES = 512 << 10


# Congestion controls that pace each flow by their own model of the path
# (`congestion`), and what a TCP link uses instead where one is the host's
# default ('auto'): reno, which every process may choose (the kernel always
# allows it), and which sends each burst as fast as the window allows.
PACED = (b'bbr',)
UNPACED = 'reno'


def congestion(conn: socket.socket) -> None:
  """Sets a TCP link's congestion control ($MULTIHOST_TCP_CONGESTION): by default reno where the host's default is one that paces (`PACED`), else the host's.

  A collective moves a burst between the job's hosts and waits for it.
  BBR (the default here) paces each flow at its model's rate: a 1 MiB
  broadcast's receiver read the burst in 8 pieces, sleeping 4 to 6 times,
  and the call took 0.36 ms, against 2 sleeps and 0.20-0.25 ms with reno
  (P=2, links over loopback TCP); 0.44 ms against 0.27-0.29 between
  simulated hosts (docs/performance.md, "The links' congestion control",
  has the loopback runs; the simulated hosts' run is not kept there).
  Where the kernel refuses
  ('auto'), the host's default stays; a name the kernel refuses was named
  when the links were made (`check_congestion`).
  """
  choice = settings.tcp_congestion()
  if choice is None or not hasattr(socket, 'TCP_CONGESTION'):  # (Linux's)
    return
  try:
    if choice == 'auto':
      now = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
      if not now.startswith(PACED):
        return
      choice = UNPACED
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, choice.encode())
  except OSError:
    pass  # (the host's default stays: see the docstring)


def check_congestion() -> None:
  """Raises ValueError when $MULTIHOST_TCP_CONGESTION names a congestion control this kernel does not let this process choose (tried on a fresh TCP socket)."""
  choice = settings.tcp_congestion()
  if choice in (None, 'auto') or not hasattr(socket, 'TCP_CONGESTION'):
    return
  probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  try:
    probe.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, choice.encode())
  except OSError as e:
    try:
      with open('/proc/sys/net/ipv4/tcp_allowed_congestion_control') as f:
        allowed = f.read().split()
    except OSError:
      allowed = ['reno']
    raise ValueError(
        f'${env.TCP_CONGESTION}={choice!r}: this kernel does not let this '
        f'process use it for TCP ({e.strerror}); choose one of '
        f'{", ".join(allowed)}, or set auto or keep.') from e
  finally:
    probe.close()


def tune(conn: socket.socket) -> None:
  """A TCP link: no delay for small frames, the buffer sizes the kernel's, the congestion control `congestion`'s. A local link: a send buffer of `LOCAL_SEND_BUFFER`.

  Setting SO_SNDBUF or SO_RCVBUF on TCP turns off the kernel's autotuning
  of that buffer, which for a large transfer grows it past any fixed size
  worth asking for (tcp_rmem's maximum): the large broadcasts ran faster
  without (measured when the links were tuned; not kept in the docs). A local (Unix domain) socket has no
  autotuning and no Nagle.
  """
  if conn.family != socket.AF_UNIX:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    congestion(conn)
  else:
    # A local link has no Nagle and no autotuning: its send buffer stays at
    # net.core.wmem_default (208 KiB here), so a 1 MiB frame went out in
    # pieces, each a wake-up on both sides, and a broadcast's source sent
    # only that much ahead of its agreement (`eager.Eager`).
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOCAL_SEND_BUFFER)


def set_timeout(conn: socket.socket, seconds: float) -> None:
  """`conn.settimeout(seconds)`, skipped when `conn` has that timeout already (each setting is a system call)."""
  if conn.gettimeout() != seconds:
    conn.settimeout(seconds)


def recv_exact(conn: socket.socket, n: int,
                deadline: Deadline | None = None) -> bytes:
  buf = bytearray(n)
  recv_into(conn, memoryview(buf), deadline)
  return bytes(buf)


def recv_by(conn: socket.socket, n: int, deadline: float) -> bytes:
  """`n` bytes, all of them by `deadline` (one limit for the lot, not per recv)."""
  buf = bytearray(n)
  view = memoryview(buf)
  got = 0
  while got < n:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
      raise TimeoutError(f'{got} of {n} bytes by the deadline')
    conn.settimeout(remaining)
    k = conn.recv_into(view[got:])
    if k == 0:
      raise ConnectionResetError('the peer closed the connection')
    got += k
  return bytes(buf)


# poll events that say the peer shut its side, or the connection failed
# (`frames.Link.open_at_peer` polls for them before it peeks).
CLOSING = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL


def open_at_peer(conn: socket.socket) -> bool:
  """Whether the peer has not closed `conn`, by a peek (bytes waiting count as open)."""
  # Python waits for a socket with a timeout to be readable before its recv,
  # whatever the flags: peek with the socket non-blocking.
  timeout = conn.gettimeout()
  try:
    conn.setblocking(False)
    try:
      return conn.recv(1, socket.MSG_PEEK) != b''
    finally:
      conn.settimeout(timeout)
  except (BlockingIOError, InterruptedError):
    return True
  except OSError:
    return False


def _unpolled(conn) -> bool:
  """Whether `conn` may be read or written once without Python's poll: a socket with a timeout, which is non-blocking underneath (never a blocking one, nor a stand-in)."""
  return isinstance(conn, socket.socket) and conn.gettimeout() is not None


def _read_ready(conn: socket.socket, views: list[memoryview]) -> int:
  """The bytes already come into `views` (filled in order; the first one not empty, else nothing is read), read with one plain read (no poll): 0 when none has, or `conn` is not `_unpolled`.

  Raises:
    ConnectionResetError: the peer closed the connection.
  """
  if not views[0] or not _unpolled(conn):
    return 0
  try:
    got = os.readv(conn.fileno(), views)
  except (BlockingIOError, InterruptedError):
    return 0
  if got == 0:
    raise ConnectionResetError('the peer closed the connection')
  return got


def recv_into(conn: socket.socket, view: memoryview,
               deadline: Deadline | None = None) -> None:
  """Fills `view`; with a `deadline`, in watched slices (`_watched`).

  A socket with a timeout is non-blocking underneath, and Python polls it
  before each recv: what has already come is read first with one plain
  read (a small frame's header or body usually has), and the watched
  slices wait only for the rest. A large rest over TCP is read in pieces
  of at least LOWAT_BYTES (SO_RCVLOWAT, reset to 1 after); a peer that
  closes or resets still wakes the reader at once.
  """
  got = _read_ready(conn, [view])
  lowat = 0
  if (len(view) - got >= LOWAT_FROM and isinstance(conn, socket.socket)
      and conn.family in (socket.AF_INET, socket.AF_INET6)):
    lowat = LOWAT_BYTES
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
  try:
    while got < len(view):
      if lowat > len(view) - got:  # The last bytes: wake for what is left.
        lowat = len(view) - got
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
      k = _watched(conn.recv_into, view[got:], deadline, idle=not got)
      if k == 0:
        raise ConnectionResetError('the peer closed the connection')
      got += k
  finally:
    if lowat:
      try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
      except OSError:  # (closed meanwhile: the read's own error stands)
        pass


def recv_some(conn: socket.socket, views: list[memoryview],
              deadline: Deadline | None = None, *, idle: bool = True) -> int:
  """Reads what has come into `views` (filled in order by one read, the first not empty: a buffer, or a frame's header and its payload's start), waiting in watched slices for at least a byte; returns the bytes read.

  `idle=False` says part of the message came before (the deadline's idle
  step then no longer runs between the slices, as in `recv_into`).
  """
  got = _read_ready(conn, views)
  if not got:
    got = (_watched(conn.recv_into, views[0], deadline, idle=idle)
           if len(views) == 1 else
           _watched(lambda v: conn.recvmsg_into(v)[0], views, deadline,
                    idle=idle))
  if got == 0:
    raise ConnectionResetError('the peer closed the connection')
  return got


def send_all(conn: socket.socket, view, deadline: Deadline) -> None:
  """Sends all of `view` in watched slices (unlike `sendall`, resumable).

  (`send_views` of one view, without its list: an agreement's every frame
  goes this way.)
  """
  view = memoryview(view).cast('B')
  sent = 0
  if view and _unpolled(conn):  # (see `recv_into`)
    try:
      sent = os.write(conn.fileno(), view)
    except (BlockingIOError, InterruptedError):
      sent = 0
  if sent < len(view):
    _send_rest(conn, view, sent, deadline)


# The most views one write takes (well below any system's IOV_MAX).
_WRITE_VIEWS = 512


def send_views(conn: socket.socket, views: list, deadline: Deadline) -> None:
  """Sends all of `views`, in order: first in one write as far as the socket takes them, the rest in watched slices.

  A frame header sent on its own goes out as a segment of its own (no
  Nagle on a link), and wakes its reader for the header alone; sent with
  the payload behind it, the reader wakes once, for both.
  """
  views = [memoryview(v).cast('B') for v in views]
  # (See `recv_into`: a socket with a timeout is written once unpolled.)
  sent = _write_now(conn, views) if _unpolled(conn) else 0
  for view in views:
    if sent >= len(view):
      sent -= len(view)
      continue
    _send_rest(conn, view, sent, deadline)
    sent = 0


def _send_rest(conn: socket.socket, view: memoryview, sent: int,
               deadline: Deadline) -> None:
  """Sends `view` from byte `sent` on, in watched slices."""
  while sent < len(view):
    sent += _watched(conn.send, view[sent:], deadline)


def send_ready(conn: socket.socket, views: list[memoryview],
               limit: int) -> int:
  """Sends of `views`, in order, what `conn` takes without waiting, up to `limit` bytes, in one write; returns the bytes sent."""
  out, room = [], limit
  for view in views:
    if room <= 0:
      break
    out.append(view[:room])
    room -= len(out[-1])
  blocking = not _unpolled(conn)
  if blocking:
    conn.setblocking(False)
  try:
    return _write_now(conn, out)
  finally:
    if blocking:
      conn.setblocking(True)


def _write_now(conn: socket.socket, views: list[memoryview]) -> int:
  """One write of the start of `views` (at most `_WRITE_VIEWS` of them) on non-blocking `conn`; the bytes it took (0 when none)."""
  views = [v for v in views[:_WRITE_VIEWS] if v]
  if not views:
    return 0
  try:
    return os.writev(conn.fileno(), views)
  except (BlockingIOError, InterruptedError):
    return 0


def _watched(io, view, deadline: Deadline | None, *,
             idle: bool = False) -> int:
  """`io(view)`, retried after each socket-timeout slice until the `deadline`.

  Between slices, raises `ProcessFailureError` once the deadline's liveness
  check knows a peer is gone, and `socket.timeout` at the deadline; while
  a read has received nothing (`idle`), the deadline's own `idle` step
  runs instead, if it has one. (A timed-out send or recv moved no bytes, so
  retrying it is safe.)
  """
  if deadline is None:
    return io(view)
  while True:
    try:
      return io(view)
    except TimeoutError:
      if idle and deadline.idle is not None:
        deadline.idle()
        continue
      deadline.check()
      if deadline.expired():
        raise
