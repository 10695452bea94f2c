"""Data plane: the local (Unix domain) sockets that link processes on one host.

Each process's plane listens on a Unix domain socket with a random abstract
name (`listener`) beside its TCP port, and publishes the name in its MAC'd
address record (`transport.tcp.auth`). A connector tries the name first
(`connect`): abstract names are scoped to the network namespace, so only a
process on the same host (and namespace) answers, and any other is refused
at once (`NotLocal`) and connects over TCP. The same handshake proves the
job secret on both; what a local socket saves is loopback's TCP stack
(measured when local links came: about half the CPU per message, twice
the bulk rate; not kept in the docs).
Linux only; `$MULTIHOST_LOCAL_LINKS=0` turns it off.
"""

from __future__ import annotations

import secrets
import socket
import struct

from multihost._src.runtime import settings
from multihost._src.transport.tcp import sockets


class NotLocal(Exception):
  """The peer's local socket name does not listen on this host (or network namespace)."""


def listener() -> socket.socket | None:
  """A listening Unix domain socket with a random abstract name, or None (off, or not Linux)."""
  if not settings.local_links():
    return None
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    listener.bind(b'\0multihost-' + secrets.token_hex(16).encode())
    listener.listen(socket.SOMAXCONN)
  except OSError:
    sockets.close(listener)
    return None
  return listener


def connect(name: str, timeout: float) -> socket.socket:
  """A connection to the local socket `name`; `NotLocal` when no such name listens here."""
  conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  conn.settimeout(timeout)
  try:
    conn.connect(b'\0' + name.encode())
  except (ConnectionRefusedError, FileNotFoundError) as e:
    sockets.close(conn)
    raise NotLocal(name) from e
  except BaseException:
    sockets.close(conn)
    raise
  return conn


_PEERCRED = struct.Struct('3i')  # pid, uid, gid


def source(conn: socket.socket, address) -> str:
  """Who connected, for the limits on pending handshakes: the IP address, or a local connection's user id."""
  if conn.family != socket.AF_UNIX:
    return address[0]
  try:
    _, uid, _ = _PEERCRED.unpack(conn.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
  except OSError:
    return 'local'
  return f'local uid {uid}'
