"""The job secret: the key that authenticates the data plane and control messages.

Where it comes from, in order: `MULTIHOST_JOB_SECRET` (the launcher sets it
for its controllers; on a cluster the user exports the same value on every
process), `MULTIHOST_JOB_SECRET_FILE` (a file only its owner may read), or,
without either, process 0 makes a random secret and shares it through the
coordination service's key-value store. That last mode keeps out a stranger
who reaches the data-plane port but not the coordination service; it does
not keep out one who can read the coordination service's keys.

A configured secret must have at least `MIN_SECRET_BYTES` bytes; it is taken
out of the environment once read (`take_from_environment`, which
`multihost.initialize()` calls), so the controllers' own children do not
inherit it.

Process 0 publishes a random job id. Every MAC and handshake proof of the
job is keyed with the job key, derived from the secret and that id by
scrypt: nothing from another run with the same secret verifies (its job id
differs), and every guess at the secret from what the store holds costs one
scrypt. Process 0 also publishes a check value (a MAC under the job key), so
that a process with a different secret fails with a clear error.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

from multihost import env
from multihost._src.liveness import blocking
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import runtime as _runtime
from multihost._src.runtime import settings

_KEY = 'multihost_secret/job'

# A configured secret shorter than this is refused: the store and the data
# plane show values keyed by it, from which a short one could be guessed.
MIN_SECRET_BYTES = 32

_JOB = 16  # bytes of the job id

_CHECK = 16  # bytes of the published check value

# scrypt's cost: 16 MiB and some tens of milliseconds once per process; the
# same for every guess of whoever tries a word list against the store.
_SCRYPT = dict(n=1 << 14, r=8, p=1, maxmem=64 << 20, dklen=32)

_HOW = ('Make one with `openssl rand -hex 32` (64 characters) and give '
        'the same value to every process.')

# The secret read from the environment (then removed from it), kept here
# under 'secret': the variable is the process's, read once, not a runtime's.
_TAKEN: dict[str, bytes] = {}


def _checked(value: bytes, where: str) -> bytes:
  if len(value) < MIN_SECRET_BYTES:
    raise errors.MultihostError(
        f'{where} holds a job secret of {len(value)} bytes; at least '
        f'{MIN_SECRET_BYTES} are needed, since values keyed by it can be '
        f'seen by whoever reaches the coordination service. {_HOW}')
  return value


def take_from_environment() -> None:
  """Reads `MULTIHOST_JOB_SECRET` (if set) and removes it from `os.environ`.

  Children that the controller starts afterwards do not inherit it; this
  process keeps it for its job keys.

  Raises:
    MultihostError: the secret is shorter than `MIN_SECRET_BYTES`.
  """
  value = os.environ.pop(env.JOB_SECRET, None)
  if value:
    _TAKEN['secret'] = _checked(value.encode(), env.JOB_SECRET)


def configured() -> bytes | None:
  """The secret the environment provides (variable or file), or None.

  Raises:
    MultihostError: the secret is too short, or its file is not a regular
      file of this user with mode 600 (checked on the opened file, which is
      opened without following a symbolic link).
  """
  take_from_environment()
  if 'secret' in _TAKEN:
    return _TAKEN['secret']
  path = settings.job_secret_file()
  if not path:
    return None
  try:
    # Not following a link, and the checks on the opened descriptor: a link
    # or a name swapped between a check and the open cannot slip in a file
    # other users can read.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC |
                 os.O_NONBLOCK)
  except OSError as e:
    raise errors.MultihostError(
        f'{env.JOB_SECRET_FILE}={path!r} cannot be opened ({e}; a symbolic '
        'link is refused); point it at a regular file that holds the job '
        'secret.') from e
  with os.fdopen(fd, 'rb') as f:
    info = os.fstat(f.fileno())
    if not stat.S_ISREG(info.st_mode):
      raise errors.MultihostError(
          f'{env.JOB_SECRET_FILE}={path!r} is not a regular file '
          f'({stat.filemode(info.st_mode)}); point it at a file that holds '
          'the job secret.')
    if (info.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or
        info.st_uid != os.getuid()):
      raise errors.MultihostError(
          f'{env.JOB_SECRET_FILE}={path!r} has mode '
          f'{stat.filemode(info.st_mode)} (owner uid {info.st_uid}): other '
          f'users could read the job secret. Run `chmod 600 {path}` as its '
          'owner.')
    value = f.read(1 << 16).strip()
  if not value:
    raise errors.MultihostError(
        f'{env.JOB_SECRET_FILE}={path!r} is empty; write a random secret '
        'into it (e.g. `openssl rand -hex 32`).')
  return _checked(value, f'{env.JOB_SECRET_FILE}={path!r}')


def derive(secret: bytes, job: bytes) -> bytes:
  """The job key: scrypt of the configured secret, salted with the job id."""
  return hashlib.scrypt(secret, salt=b'multihost job key\0' + job, **_SCRYPT)


def _check(key: bytes) -> bytes:
  return hmac.digest(key, b'multihost secret check', hashlib.sha256)[:_CHECK]


def job_keys(op: str = 'job secret', *, timeout: float,
             runtime: _runtime.Runtime | None = None) -> tuple[bytes, bytes]:
  """(job id, job key), the same on every process (agreed once per runtime, then kept).

  The job key is what every MAC and proof of this job is keyed with; it
  differs from one job to the next even with the same configured secret.

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
  """The job key for collective `op` (as `job_keys`), the client's errors raised as a timeout on process 0.

  Raises:
    MultihostError: as `job_keys`.
    CollectiveTimeoutError: process 0 did not publish the job id in time.
  """
  rt = runtime or _runtime.current()
  try:
    return job_keys(op, timeout=timeout, runtime=rt)[1]
  except errors.MultihostError:
    raise
  except Exception as e:  # The client raises JaxRuntimeError. # noqa: BLE001
    raise failures.transfer_timeout(op, 0, 'to publish the job id',
                                        me=rt.index) from e


def _agree(rt: _runtime.Runtime, op: str,
           timeout: float) -> tuple[bytes, bytes]:
  mine = configured()
  me = rt.index
  if me == 0:
    job = secrets.token_bytes(_JOB)
    if mine is None:
      key = secrets.token_bytes(32)
      value = job + b'K' + key
    else:
      key = derive(mine, job)
      value = job + b'F' + _check(key)
    rt.service().kv_set(_KEY, value)
    return job, key
  value = blocking.call(op, rt.service().kv_get, _KEY, timeout, runtime=rt)
  job, mode, rest = value[:_JOB], value[_JOB:_JOB + 1], value[_JOB + 1:]
  if mode == b'K':
    if mine is not None:
      raise errors.MultihostError(
          f'process {me} has a job secret ({env.JOB_SECRET} or '
          f'{env.JOB_SECRET_FILE}) but process 0 has none. Give every '
          'process the same secret, or none.')
    return job, rest
  if mine is None:
    raise errors.MultihostError(
        f'process {me} has no job secret but process 0 has one. Set '
        f'{env.JOB_SECRET} (or {env.JOB_SECRET_FILE}) to the same value on '
        'every process.')
  key = derive(mine, job)
  if not hmac.compare_digest(_check(key), rest):
    raise errors.MultihostError(
        f'process {me}\'s job secret differs from process 0\'s. Set '
        f'{env.JOB_SECRET} (or {env.JOB_SECRET_FILE}) to the same value on '
        'every process.')
  return job, key
