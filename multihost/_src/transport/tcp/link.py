"""Data plane: the TCP transport's links (listener, handshake proving the job secret, lanes) and the plane that holds them.

Connections are opened on first use: every process listens on an ephemeral
port of the interface that reaches the coordinator, publishes its address in
the coordination service's key-value store (with a MAC under the job key, so
a store writer cannot point a process at a relay), and the lower-numbered
process of each pair connects. Both sides prove the job secret (HMAC over
both nonces, the lane and the job id) before a link is kept; every frame
header after that carries a MAC under the link's key for its direction and
a frame number (`transport.tcp.frames`), so injected, replayed or reordered frames
are refused. Each pair of processes has `lanes` links (lane 0 for the
agreement and every transfer, the others for large broadcasts' stripes).
The plane is the runtime's (`Runtime.plane`), made on the first transfer.

The handshake, and the bounds that keep strangers who reach the port from
holding it, are `transport.tcp.handshake`'s. A connector whose handshake
was cut tries again until the transfer's deadline. After a failed transfer the links are closed and opened afresh by
the next transfer (new nonces, new keys, frame numbers from 0).

Processes on one host link over a local socket instead, found through the
same record and proven by the same handshake (`transport.tcp.local`).
"""

from __future__ import annotations

from collections.abc import Callable
import socket
import threading
import time

from multihost._src.auth import secret
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import runtime as _runtime
from multihost._src.runtime import settings
from multihost._src.runtime.deadline import Deadline
from multihost._src.transport.tcp import auth
from multihost._src.transport.tcp import errors as _tcp_errors
from multihost._src.transport.tcp import frames
from multihost._src.transport.tcp import handshake
from multihost._src.transport.tcp import local as _local
from multihost._src.transport.tcp import sockets
from multihost._src.transport.tcp import stage as _stage
from multihost._src.transport.tcp import threads

_RETRY_S = 0.05  # between a connector's attempts after a cut handshake


def _key(peer: int, lane: int) -> Key:
  """`Plane.conns`' key of the link to `peer` on `lane` (lane 0's is the peer)."""
  return peer if lane == 0 else (peer, lane)


Link = frames.Link
# `Plane.conns`' key: the peer (lane 0), or (peer, lane).
Key = int | tuple[int, int]


class Plane:
  """This process's listener and its connections to peers."""

  def __init__(self, rt: _runtime.Runtime, timeout: float, op: str):
    self.rt = rt
    self.me = rt.index
    self.count = rt.count
    self.job, self.secret = secret.job_keys(op, timeout=timeout, runtime=rt)
    self.seq = 0  # The last transfer's id (`transfer_id`).
    # Whether calls agree in a star at process 0 (`control.links`).
    self.star = False
    # Whether calls agree over the links, and the links' setup for that
    # (see `control.links.met`).
    self.agrees = False
    self.setup: str | None = None
    self.setup_error = ''
    self.refused = False  # a process could not set its links up
    # `conns_lock` is `lock`'s own lock: `conn`, on every call's path, enters
    # it without the Condition's Python-level wrapper.
    self.conns_lock = threading.RLock()
    self.lock = threading.Condition(self.conns_lock)
    self.connecting = threading.Lock()
    self.conns: dict[Key, Link] = {}
    self.sends = threads.SendThread()  # every transfer's background sends
    # The links per peer a large broadcast stripes over, and a thread for
    # each lane past the first (which runs on the calling thread).
    self.lanes = settings.tcp_lanes()
    self.lane_threads = [threads.Lane(f'multihost-transport-lane-{k}')
                         for k in range(1, self.lanes)]
    # Whether this process's host has more cores than processes of this
    # job (set at the links' setup, `control.links`); then a broadcast's
    # source copies its own result on `copier` (`tcp.eager.Eager`).
    self.spare_cores = False
    self.copier = threads.Lane('multihost-transport-copy')
    # Whether every process publishes this host and a local socket (set at
    # the links' setup, `control.links`): then large broadcasts go through
    # the source's stage, which local links pass at their handshake
    # (`tcp.shared`, `tcp.stage`).
    self.one_host = False
    self.stage = _stage.Stage.make() if settings.local_links() else None
    self.acceptor = handshake.Acceptor(me=self.me, job=self.job,
                                       secret=self.secret, lock=self.lock,
                                       on_link=self._accepted,
                                       stage=self.stage)
    host = auth.local_host(rt)
    self.listener = socket.socket(sockets.family(host), socket.SOCK_STREAM)
    self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self.listener.bind((host, 0))
    # The kernel's largest backlog: a port scan of a few hundred connections
    # must not fill the accept queue, where the SYN of a peer's real connect
    # would be dropped and sent again only a second later.
    self.listener.listen(socket.SOMAXCONN)
    port = self.listener.getsockname()[1]
    self.local_listener = _local.listener()
    self.local = ''  # its name, published without the leading NUL
    for listener in (self.listener, self.local_listener):
      if listener is not None:
        threading.Thread(target=self.acceptor.serve, args=(listener,),
                         name='multihost-transport', daemon=True).start()
    if self.local_listener is not None:
      self.local = self.local_listener.getsockname()[1:].decode()
    rt.service().kv_set(auth.ADDRESS_KEY.format(self.me),
                        auth.address_record(self.secret, self.me, host, port,
                                            self.local))

  def _accepted(self, peer: int, lane: int, link: Link) -> None:
    """Keeps a link `peer` proved on `lane` (the acceptor calls it under `lock`)."""
    # A proven new connection replaces the old link: the peer closed its end
    # of that one after a failed transfer.
    old = self.conns.get(_key(peer, lane))
    if old is not None:
      sockets.close(old.sock)
    self.conns[_key(peer, lane)] = link
    self.lock.notify_all()

  def host_records(self, op: str,
                   deadline: float) -> list[tuple[str, str]]:
    """Every process's (host, local socket name), as its authenticated address record says (one read per process); the name is '' where local links are off.

    Raises:
      MultihostError: a record failed authentication.
      Exception: the service did not return a record by `deadline`.
    """
    return [self._address(p, max(deadline - time.monotonic(), 0.001), op)[::2]
            for p in range(self.count)]

  def _address(self, peer: int, remaining: float,
               op: str) -> tuple[str, int, str]:
    """(host, port, local socket name) from `peer`'s address record, authenticated; waits up to `remaining` seconds for it."""
    value = self.rt.service().kv_get(auth.ADDRESS_KEY.format(peer), remaining)
    return auth.read_address(self.secret, peer, value, op)

  def _connect(self, peer: int, lane: int, remaining: float,
               op: str) -> Link:
    """Opens and authenticates a connection to the higher-numbered `peer`."""
    deadline = time.monotonic() + remaining
    host, port, local = self._address(peer, remaining, op)
    # The local socket when the peer's name answers on this host; else
    # (another host or network namespace: refused at once) TCP.
    if not settings.local_links():
      local = ''
    while True:
      try:
        return self._connect_once(peer, lane, (host, port), local, deadline)
      except _local.NotLocal:
        local = ''
      except (ConnectionResetError, BrokenPipeError, BlockingIOError) as e:
        # Cut during the handshake (e.g. as the oldest pending one while
        # strangers crowd the port), or a local listener's full backlog:
        # try again while there is time.
        if time.monotonic() + _RETRY_S >= deadline:
          raise _tcp_errors.Unreachable(_where(host, port, local), e) from e
        time.sleep(_RETRY_S)

  def _connect_once(self, peer: int, lane: int, address: tuple[str, int],
                    local: str, deadline: float) -> Link:
    """One attempt of `_connect`: to the peer's `local` socket if named, else to its TCP `address`."""
    remaining = max(deadline - time.monotonic(), 0.001)
    where = _where(*address, local)
    try:
      if local:
        conn = _local.connect(local, remaining)
      else:
        conn = socket.create_connection(address, timeout=remaining)
    except (_local.NotLocal, ConnectionResetError, BrokenPipeError,
            BlockingIOError):
      raise
    except OSError as e:
      raise _tcp_errors.Unreachable(where, e) from e
    try:
      return handshake.connect(conn, me=self.me, peer=peer, lane=lane,
                               job=self.job, secret=self.secret, where=where,
                               prefix=self.rt.prefix, stage=self.stage)
    except BaseException:
      sockets.close(conn)
      raise

  def conn(self, peer: int, deadline: float, op: str, lane: int = 0, *,
           idle: Callable[[], None] | None = None) -> Link:
    """The link to `peer` on `lane`, opened (or awaited) anew if there is none or the peer closed it.

    A link to a lower-numbered peer is awaited (that peer connects):
    between the waits' slices `idle` runs if given (it may raise: the
    agreement's diagnosis and timeout), else the watchdog is checked.
    """
    key = _key(peer, lane)
    with self.conns_lock:
      link = self.conns.get(key)
      if link is not None and not link.open_at_peer():
        del self.conns[key]  # The peer dropped it after a failed transfer.
        sockets.close(link.sock)
        link = None
    if link is not None:
      if link.owed:  # Outside the lock: the peer may take a while to read.
        _pay_owed(link, peer, Deadline(op, deadline, self.rt.watchdog),
                  self.rt.watchdog)
      return link
    if self.me < peer:
      # One connector at a time (the agreement's link setup runs on a thread
      # of its own): a second connection would replace the first.
      # Errors are named after the lock is released (`Unreachable`).
      try:
        with self.connecting:
          with self.lock:
            link = self.conns.get(key)
          if link is None:
            link = self._connect(
                peer, lane, max(deadline - time.monotonic(), 0.001), op)
            with self.lock:
              self.conns[key] = link
          return link
      except errors.MultihostError:
        raise
      except (OSError, TimeoutError, _tcp_errors.Unreachable) as e:
        raise _tcp_errors.peer_error(op, peer, e, self.rt.watchdog) from e
      except Exception as e:  # noqa: BLE001
        raise _tcp_errors.peer_error(op, peer, e, self.rt.watchdog,
                                     waiting=True) from e
    while True:
      with self.lock:
        if key in self.conns:
          return self.conns[key]
        remaining = deadline - time.monotonic()
        if remaining <= 0 and idle is None:
          raise failures.connect_timeout(op, peer, None)
        # (With `idle`, it raises at the deadline, or waits on past it.)
        self.lock.wait(min(remaining, 0.5) if remaining > 0
                       else sockets.SLICE_S)
        if key in self.conns:
          return self.conns[key]
      # Outside the lock, which the acceptor takes to keep a new link:
      # `idle` may ask the coordination service.
      if idle is not None:
        idle()
      else:
        self.rt.watchdog.check(op)


def _where(host: str, port: int, local: str) -> str:
  """A link's address, for messages: the local socket's name, or host:port."""
  return f'the local socket @{local}' if local else f'{host}:{port}'


def _pay_owed(link: Link, peer: int, deadline: Deadline,
              liveness: _tcp_errors.Watched) -> None:
  """Sends what `link` owes its peer (see `Link.owed`); `liveness` names a dead peer."""
  owed, link.owed = link.owed, None
  try:
    for view in owed or ():
      sockets.send_all(link.sock, view, deadline)
  except (OSError, TimeoutError) as e:
    sockets.close(link.sock)
    raise _tcp_errors.peer_error(op=deadline.op, peer=peer, error=e,
                                 liveness=liveness) from e


def transfer_id(plane: Plane) -> int:
  """The id the next transfer's data frames carry: its collective call's number.

  Every process numbers the calls alike, and a call makes one transfer at
  most; so after a call that some processes left before its transfer (the
  agreement timed out on them, not on the others) and others after it, the
  next transfer still has one id everywhere. (Transfers outside a call,
  as in tests, count on from the last.)
  """
  return max(plane.seq + 1, plane.rt.call)


def get_plane(op: str, deadline: float,
               runtime: _runtime.Runtime | None = None) -> Plane:
  """The runtime's plane (made on first use), with `seq` the id of this transfer (`transfer_id`)."""
  plane = plane_of(runtime or _runtime.current(), op, deadline)
  plane.seq = transfer_id(plane)
  return plane


def agreeing(rt: _runtime.Runtime) -> bool:
  """Whether the links are set up for the agreement (every process set them up in the same call)."""
  plane = rt.plane
  return plane is not None and plane.agrees and not rt.service_only


def plane_of(rt: _runtime.Runtime, op: str, deadline: float) -> Plane:
  """The runtime's plane, made (listening, its address published) on first use."""
  with rt.lock:
    if rt.plane is None:
      settings.tcp_lanes()  # a bad setting raises as itself, not as a timeout
      sockets.check_congestion()
      try:
        rt.plane = Plane(rt, max(deadline - time.monotonic(), 0.001), op)
      except errors.MultihostError:
        raise
      except Exception as e:  # noqa: BLE001
        raise failures.transfer_timeout(op, 0,
                                            'to publish the job id') from e
    return rt.plane


def break_plane(plane: Plane, error: BaseException | None) -> None:
  """Closes every link (bytes of a failed transfer may be in flight); the next transfer opens new ones."""
  del error
  with plane.lock:
    for link in plane.conns.values():
      try:  # Wakes a thread blocked on it (a close alone may not).
        link.sock.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
      sockets.close(link.sock)
    plane.conns.clear()


def close_plane(plane: Plane) -> None:
  """Closes the listener and every link (its accept thread then ends)."""
  break_plane(plane, None)
  plane.sends.stop()
  for lane in (*plane.lane_threads, plane.copier):
    lane.stop()
  for listener in (plane.listener, plane.local_listener):
    if listener is None:
      continue
    try:  # Wakes the accept thread (a close alone does not, on Linux).
      listener.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
    sockets.close(listener)
  if plane.stage is not None:
    plane.stage.close()
