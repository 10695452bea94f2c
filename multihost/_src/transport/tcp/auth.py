"""Data plane: the TCP links' credentials (handshake proofs, per-direction frame keys, the MAC'd address records).

The handshake is `transport.tcp.handshake`'s and the records
`transport.tcp.link`'s; what proves the job secret lives here, so that the
connection logic and its cryptography can be read (and reviewed) apart.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct

from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import runtime
from multihost._src.transport.tcp import sockets

ADDRESS_KEY = 'multihost_transport/{}'

_MAC = 16


def proof(secret: bytes, label: bytes, job: bytes, low: int, high: int,
          nonces: bytes) -> bytes:
  """HMAC-SHA256 under the job secret binding `label`, the job, the pair and both nonces."""
  message = label + job + struct.pack('<II', low, high) + nonces
  return hmac.digest(secret, message, hashlib.sha256)


def link_keys(secret: bytes, job: bytes, low: int, high: int, nonces: bytes,
              *, connector: bool) -> tuple[bytes, bytes]:
  """(send key, receive key) of a link, one key per direction."""
  up = proof(secret, b'frames low->high', job, low, high, nonces)
  down = proof(secret, b'frames high->low', job, low, high, nonces)
  return (up, down) if connector else (down, up)


def _address_mac(key: bytes, index: int, text: bytes) -> str:
  return hmac.digest(key, b'address\0' + ADDRESS_KEY.format(index).encode()
                     + b'\0' + text, hashlib.sha256)[:_MAC].hex()


def address_record(key: bytes, index: int, host: str, port: int,
                   local: str = '') -> bytes:
  """What process `index` publishes under ADDRESS_KEY: 'host|port|local|MAC' (`local`: its local socket's name, or '')."""
  text = f'{host}|{port}|{local}'.encode()
  return text + b'|' + _address_mac(key, index, text).encode()


def read_address(key: bytes, index: int, value: bytes,
                 op: str) -> tuple[str, int, str]:
  """(host, port, local socket name or '') of process `index`'s record; raises unless it wrote it."""
  text, _, mac = value.rpartition(b'|')
  try:
    ok = hmac.compare_digest(mac.decode(), _address_mac(key, index, text))
    host, port_text, local = text.decode().split('|')
    port = int(port_text)
  except ValueError:
    ok = False
  if not ok:
    raise errors.MultihostError(
        f'{failures.prefix()} {op}: the data-plane address under '
        f'{ADDRESS_KEY.format(index)!r} failed authentication: it was not '
        f'written by process {index} of this job (someone who reaches the '
        'coordination service wrote it, or a process has another job '
        'secret). Nothing was sent to it. Give every process the same job '
        'secret, and keep the coordination service\'s port firewalled (see '
        'docs/trust.md, "Trust model").')
  return host, port, local


def local_host(rt: runtime.Runtime) -> str:
  """The address of the interface that reaches the coordinator."""
  address = rt.service_address or '127.0.0.1:0'
  host = address.rsplit(':', 1)[0].strip('[]')
  try:
    probe = socket.socket(sockets.family(host), socket.SOCK_DGRAM)
    probe.connect((host, 9))
    return probe.getsockname()[0]
  except OSError:
    return '127.0.0.1'


