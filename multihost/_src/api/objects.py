"""Object collectives' payloads: pickled, sealed with the job secret, size-limited.

The object collectives pickle, as torch's do. A payload is unpickled only
after its seal checks: a fresh nonce and HMAC-SHA256(job secret, nonce +
payload), carried in the sender's (authenticated) call header. Bytes that
were altered, replayed from another call or planted are refused before
`pickle.loads` sees them, and a payload larger than the limit
(MULTIHOST_MAX_OBJECT_BYTES, default 1 GiB) is refused on every process
before it moves.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import secrets
import struct
from typing import Any

from multihost import env
from multihost._src.auth import secret as _secret
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import settings

_NONCE = 16
# An object's record in a call's agreement (`record`): its size, its
# seal's length, whether its bytes follow, then the seal and the bytes.
_RECORD = struct.Struct('<QHB')


def max_object_bytes() -> int:
  """The largest pickled object that `broadcast_object` or `allgather_object` accepts from one process, in bytes.

  $MULTIHOST_MAX_OBJECT_BYTES, else 1 GiB. A caller with more to send
  sends its arrays through `multihost.exchange`, which carries NumPy arrays
  outside this limit (as recovery's local tier does).
  """
  return settings.max_object_bytes()


def dumps(obj: Any) -> bytes:
  return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def seal(op: str, data: bytes, timeout: float) -> bytes:
  """A fresh nonce and the MAC of `data` under the job secret."""
  nonce = secrets.token_bytes(_NONCE)
  secret = _secret.job_secret(op, timeout=timeout)
  return nonce + _mac(secret, nonce, data)


def _mac(secret: bytes, nonce: bytes, data) -> bytes:
  """HMAC-SHA256(secret, nonce + data), without joining them (a copy)."""
  mac = hmac.new(secret, nonce, hashlib.sha256)
  mac.update(data)
  return mac.digest()


def check_size(op: str, process: int, size: int) -> None:
  """Raises (on every process alike) if `process`'s object is over the limit."""
  limit = settings.max_object_bytes()
  if size > limit:
    raise errors.MultihostError(
        f'{failures.prefix()} {op}: process {process}\'s pickled object '
        f'is {size} bytes, over the limit of {limit} bytes. Send less, or '
        f'raise {env.MAX_OBJECT_BYTES} on every process.')


def loads(op: str, process: int, data, sealed: bytes | None,
          timeout: float, buffers=()) -> Any:
  """Unpickles `process`'s `data` (bytes-like; its out-of-band `buffers`) if its seal checks; raises otherwise."""
  secret = _secret.job_secret(op, timeout=timeout)
  ok = sealed is not None and len(sealed) > _NONCE and hmac.compare_digest(
      sealed[_NONCE:], _mac(secret, sealed[:_NONCE], data))
  if not ok:
    raise errors.MultihostError(
        f'{failures.prefix()} {op}: the object bytes received from '
        f'process {process} do not match the seal in its authenticated call '
        'header (altered or replayed on the way); they were not unpickled. '
        'Restart the job, and firewall the data-plane ports (see '
        'docs/trust.md, "Trust model").')
  return pickle.loads(data, buffers=buffers)


def record(header) -> bytes:
  """What a process shares of its object in the call's agreement: the size, seal and inline bytes of its `agree.Header` (where the header itself need not be exchanged)."""
  inline = header.payload is not None
  return b''.join((_RECORD.pack(header.size, len(header.seal), inline),
                   header.seal, header.payload or b''))


def read_record(op: str, process: int,
                value) -> tuple[int, bytes, bytes | None]:
  """(size, seal, inline bytes or None) of `process`'s `record`; raises if it holds none."""
  try:
    size, sealed, inline = _RECORD.unpack_from(value)
  except struct.error:
    size = sealed = inline = None
  start = _RECORD.size
  if size is None or len(value) != start + sealed + (size if inline else 0):
    raise errors.MultihostError(
        f'{failures.prefix()} {op}: process {process}\'s record of its '
        f'object ({len(value)} bytes) does not hold a size, a seal and its '
        'bytes; every process must run the same version of multihost.')
  seal = bytes(value[start:start + sealed])
  return size, seal, bytes(value[start + sealed:]) if inline else None
