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
from typing import Any

from multihost import env
from multihost._src.auth import secret as _secret
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import settings

_NONCE = 16


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
          timeout: float) -> Any:
  """Unpickles `process`'s `data` (bytes-like) if its seal checks; raises otherwise."""
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
  return pickle.loads(data)
