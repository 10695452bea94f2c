"""The job secret: the key that authenticates the data plane and control messages.

Where it comes from, in order: `MULTIHOST_JOB_SECRET` (the launcher sets it
for its controllers; on a cluster the user exports the same value on every
process), `MULTIHOST_JOB_SECRET_FILE` (a file only its owner may read), or,
without either, process 0 makes a random secret and shares it through the
coordination service's key-value store. That last mode keeps out a stranger
who reaches the data-plane port but not the coordination service; it does
not keep out one who can read the coordination service's keys.

Process 0 also publishes a random job id (so handshakes of one job never
authenticate in another that shares the secret) and a fingerprint of its
secret, so a process with a different secret fails with a clear error.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

from multihost import _blocking
from multihost import _diagnostics
from multihost import _errors
from multihost import _runtime
from multihost import env

_KEY = 'multihost_secret/job'


def configured() -> bytes | None:
  """The secret the environment provides (variable or file), or None."""
  value = env.get(env.JOB_SECRET)
  if value:
    return value.encode()
  path = env.get(env.JOB_SECRET_FILE)
  if not path:
    return None
  try:
    info = os.stat(path)
  except OSError as e:
    raise _errors.MultihostError(
        f'{env.JOB_SECRET_FILE}={path!r} cannot be read ({e}); point it at '
        'a file that holds the job secret.') from e
  if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or info.st_uid != os.getuid():
    raise _errors.MultihostError(
        f'{env.JOB_SECRET_FILE}={path!r} has mode '
        f'{stat.filemode(info.st_mode)} (owner uid {info.st_uid}): other users '
        f'could read the job secret. Run `chmod 600 {path}` as its owner.')
  with open(path, 'rb') as f:
    value = f.read().strip()
  if not value:
    raise _errors.MultihostError(
        f'{env.JOB_SECRET_FILE}={path!r} is empty; write a random secret '
        'into it (e.g. `openssl rand -hex 32`).')
  return value


def _fingerprint(secret: bytes) -> bytes:
  return hmac.digest(secret, b'multihost fingerprint', hashlib.sha256)[:8]


def job_keys(op: str = 'job secret', *, timeout: float,
             runtime: _runtime.Runtime | None = None) -> tuple[bytes, bytes]:
  """(job id, secret), the same on every process (agreed once per runtime, then kept).

  Raises:
    ProcessFailureError: process 0 is gone (while waiting for its job id).
  """
  rt = runtime or _runtime.current()
  keys = rt.job_keys
  if keys is None:
    with rt.secret_lock:
      keys = rt.job_keys
      if keys is None:
        keys = rt.job_keys = _agree(rt, op, timeout)
  return keys


def job_secret(op: str, *, timeout: float,
               runtime: _runtime.Runtime | None = None) -> bytes:
  """The job secret for collective `op` (as `job_keys`), the client's errors raised as a timeout on process 0.

  Raises:
    MultihostError: as `job_keys`.
    CollectiveTimeoutError: process 0 did not publish the job id in time.
  """
  rt = runtime or _runtime.current()
  try:
    return job_keys(op, timeout=timeout, runtime=rt)[1]
  except _errors.MultihostError:
    raise
  except Exception as e:  # The client raises JaxRuntimeError. # noqa: BLE001
    raise _diagnostics.transfer_timeout(op, 0, 'to publish the job id',
                                        me=rt.index) from e


def _agree(rt: _runtime.Runtime, op: str,
           timeout: float) -> tuple[bytes, bytes]:
  mine = configured()
  me = rt.index
  if me == 0:
    job = secrets.token_bytes(16)
    if mine is None:
      secret = secrets.token_bytes(32)
      value = job + b'K' + secret
    else:
      secret = mine
      value = job + b'F' + _fingerprint(secret)
    rt.client.kv_set(_KEY, value)
    return job, secret
  value = _blocking.call(op, rt.client.kv_get, _KEY, timeout, runtime=rt)
  job, mode, rest = value[:16], value[16:17], value[17:]
  if mode == b'K':
    if mine is not None:
      raise _errors.MultihostError(
          f'process {me} has a job secret ({env.JOB_SECRET} or '
          f'{env.JOB_SECRET_FILE}) but process 0 has none. Give every '
          'process the same secret, or none.')
    return job, rest
  if mine is None:
    raise _errors.MultihostError(
        f'process {me} has no job secret but process 0 has one. Set '
        f'{env.JOB_SECRET} (or {env.JOB_SECRET_FILE}) to the same value on '
        'every process.')
  if not hmac.compare_digest(_fingerprint(mine), rest):
    raise _errors.MultihostError(
        f'process {me}\'s job secret differs from process 0\'s. Set '
        f'{env.JOB_SECRET} (or {env.JOB_SECRET_FILE}) to the same value on '
        'every process.')
  return job, mine
