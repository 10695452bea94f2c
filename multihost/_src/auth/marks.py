"""Control plane: what a call leaves in the coordination service for its diagnosis (MACs, gave-up marks, who published).

Shared by the two ways a call agrees (`_control_rendezvous` through the
service, `_control_links` over the TCP links): either way a process that
times out leaves an authenticated mark beside the call's messages, so that
a latecomer raises at once, and a timeout names the processes without a
message under the call's directory.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from multihost._src.auth import secret as _secret
from multihost._src.runtime import coordination
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import runtime

# (Not inside the call's directory, where only the processes' keys belong.)
GAVE_UP = '.gave-up/'
_GAVE_UP_MARK = b'gave up'  # MAC'd under the mark's key (see `gave_up`)
# Bytes of HMAC-SHA256(job key, key + flag + message). The job key is
# derived from the secret and this job's random id (`_secret`), so a
# message recorded in another run with the same secret does not verify.
MAC = 16


def mac(secret: bytes, key: str, value: bytes) -> bytes:
  return hmac.digest(secret, key.encode() + b'\0' + value,
                     hashlib.sha256)[:MAC]


def leave_mark(rt: runtime.Runtime, op: str, prefix: str,
               start: float) -> None:
  """Marks that this process gave up the call under `prefix` (best effort).

  The mark holds when it started the call (wall clock): the latecomer says
  how late it came. MAC'd, so a planted mark changes nothing.
  """
  try:
    key = prefix[:-1] + GAVE_UP + str(rt.index)
    started = repr(time.time() - (time.monotonic() - start)).encode()
    secret = _secret.job_secret(op, timeout=1.0, runtime=rt)
    rt.client.kv_set(key, mac(secret, key, _GAVE_UP_MARK + started) + started)
  except Exception:  # noqa: BLE001  The service may be gone; best effort.
    pass


def gave_up(rt: runtime.Runtime, op: str, prefix: str) -> list[float]:
  """When each process with an authentic gave-up mark for the call under `prefix` started it (wall clock).

  A mark that fails authentication, or names no process of this job, was
  planted by someone who reaches the store: it is ignored, so it cannot
  make every process raise a timeout that did not happen.
  """
  where = prefix[:-1] + GAVE_UP
  secret = _secret.job_secret(op, timeout=1.0, runtime=rt)
  keys = {where + str(p) for p in range(rt.count)}
  starts = []
  for key, stored in rt.client.kv_dir(where):
    tag, started = stored[:MAC], stored[MAC:]
    if key in keys and hmac.compare_digest(
        tag, mac(secret, key, _GAVE_UP_MARK + started)):
      try:
        starts.append(float(started))
      except ValueError:
        pass
  return starts


def late_by(starts: list[float], start: float) -> float | None:
  """How much later than the last of those that gave up this process started the call.

  By the hosts' wall clocks (each mark holds when its process started);
  None if there is no mark.
  """
  if not starts:
    return None
  return time.time() - (time.monotonic() - start) - max(starts)


def named(rt: runtime.Runtime, error: BaseException, op: str, where: str, *,
          waited: float, timeout: float) -> errors.MultihostError:
  """The named error for a coordination-service failure (see `_diagnostics`)."""
  present = None
  if where.endswith('/'):
    present = lambda: published(rt, where)  # noqa: E731
  watchdog = rt.watchdog
  error_named = failures.coordination_failure(
      error, op, me=rt.index, count=rt.count, waited=waited, timeout=timeout,
      known=watchdog.known_failure(op, waited=waited, cause=error),
      tasks=coordination.tasks_in(str(error)), published=present,
      source=rt.timeout_source(timeout))
  if isinstance(error_named, errors.ProcessFailureError):
    watchdog.peer_loss.delivered()  # Raised to the program (see _watchdog).
  return error_named


def absent(rt: runtime.Runtime, where: str) -> list[int]:
  """The processes without a message under `where` (none known if it is no directory)."""
  if not where.endswith('/'):
    return []
  present = set(published(rt, where))
  return [p for p in range(rt.count) if p not in present]


def published(rt: runtime.Runtime, prefix: str) -> list[int]:
  """The processes with a message under `prefix` (none if the store is gone)."""
  try:
    expected = {prefix + str(p): p for p in range(rt.count)}
    return [expected[key] for key, _ in rt.client.kv_dir(prefix)
            if key in expected]
  except Exception:  # noqa: BLE001
    return []
