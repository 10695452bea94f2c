"""Auth: what a barrier leaves in the coordination service for its diagnosis (MACs, gave-up and presence marks, who published).

One implementation for every barrier: the two ways a call agrees
(`control.rendezvous` through the service, `control.rounds` over the TCP
links) and the timed barrier of the live processes that `live_devices`
blocks meet at (`control.live_barrier`). Either way a process that times
out leaves an authenticated mark beside the call's messages, so that a
latecomer raises at once, and a timeout names the processes without an
authenticated message (or presence mark) under the call's directory.

Whoever reaches the store can write any key: every mark is MAC'd with the
job key (`auth.secret`) over its key and value, and one that does not verify,
or sits under the key of no process of the barrier, is ignored. A planted
mark can neither make a process raise a timeout that did not happen nor
change which processes a timeout names.
"""

from __future__ import annotations

from collections.abc import Iterable
import hashlib
import hmac
import time
from typing import NamedTuple

from multihost._src.auth import secret as _secret
from multihost._src.runtime import coordination
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import runtime

# Beside the call's directory (`beside`), not inside it, where only the
# processes' keys belong: the gave-up marks, and the presence marks of a
# barrier whose processes publish no message (the live barrier).
GAVE_UP = '.gave-up/'
HERE = '.here/'
# Beside the call's directory too: the call's outcome record (`settle`).
OUTCOME = '.outcome'
DONE = b'done'
GIVEN_UP = b'given up'
_GAVE_UP_MARK = b'gave up'  # MAC'd under the mark's key (see `gave_up`)
_HERE_MARK = b'here'  # a presence mark's value (see `leave_presence`)
# Bytes of HMAC-SHA256(job key, key + flag + message). The job key is
# derived from the secret and this job's random id (`auth.secret`), so a
# message recorded in another run with the same secret does not verify.
MAC = 16


class Mark(NamedTuple):
  """An authentic gave-up mark: who left it, when it started the call (wall clock), whom it gave up on."""

  process: int
  started: float
  given_up_on: frozenset[int]


def mac(secret: bytes, key: str, value: bytes) -> bytes:
  return hmac.digest(secret, key.encode() + b'\0' + value,
                     hashlib.sha256)[:MAC]


def authentic(secret: bytes, key: str, stored: bytes) -> bool:
  """Whether `stored` is a value that a process of this job put under `key` (its MAC, then the value)."""
  return len(stored) >= MAC and hmac.compare_digest(
      stored[:MAC], mac(secret, key, stored[MAC:]))


def beside(prefix: str, kind: str) -> str:
  """The place of the marks of `kind` (the `GAVE_UP` and `HERE` directories, the `OUTCOME` record) of the call whose messages are under `prefix`."""
  return prefix[:-1] + kind


def _keys(rt: runtime.Runtime, where: str,
          processes: Iterable[int] | None) -> dict[str, int]:
  """The key under `where` of each process of the barrier (default: every process of the job)."""
  return {where + str(p): p
          for p in (range(rt.count) if processes is None else processes)}


def leave_mark(rt: runtime.Runtime, op: str, prefix: str, start: float, *,
               given_up_on: Iterable[int] = ()) -> None:
  """Marks that this process gave up the call under `prefix`, and on which processes (best effort).

  The mark holds when it started the call (wall clock): the latecomer says
  how late it came. MAC'd, so a planted mark changes nothing.
  """
  try:
    key = beside(prefix, GAVE_UP) + str(rt.index)
    started = repr(time.time() - (time.monotonic() - start))
    value = f'{started}|{",".join(map(str, sorted(given_up_on)))}'.encode()
    secret = _secret.job_secret(op, timeout=1.0, runtime=rt)
    rt.service().kv_set(key, mac(secret, key, _GAVE_UP_MARK + value) + value)
  except Exception:  # noqa: BLE001  The service may be gone; best effort.
    pass


def gave_up(rt: runtime.Runtime, op: str, prefix: str, *,
            processes: Iterable[int] | None = None) -> list[Mark]:
  """The authentic gave-up marks of the call under `prefix`, of `processes` (default: every process of the job).

  A mark that fails authentication, or names no process of the barrier,
  was planted by someone who reaches the store: it is ignored, so it cannot
  make every process raise a timeout that did not happen.
  """
  where = beside(prefix, GAVE_UP)
  secret = _secret.job_secret(op, timeout=1.0, runtime=rt)
  keys = _keys(rt, where, processes)
  marks = []
  for key, stored in rt.service().kv_dir(where):
    value = stored[MAC:]
    if key not in keys or not hmac.compare_digest(
        stored[:MAC], mac(secret, key, _GAVE_UP_MARK + value)):
      continue  # planted: it changes nothing
    started, _, whom = value.decode(errors='replace').partition('|')
    try:
      marks.append(Mark(keys[key], float(started),
                        frozenset(int(p) for p in whom.split(',') if p)))
    except ValueError:
      pass
  return marks


def settle(rt: runtime.Runtime, op: str, prefix: str,
           outcome: bytes) -> tuple[bytes, int]:
  """The outcome of the call under `prefix`, decided once for every process: (`DONE` or `GIVEN_UP`, the process that decided it).

  The first process to settle decides (the service creates the record
  atomically); every later one reads that decision. MAC'd with the job key.

  Raises:
    MultihostError: the record does not verify (someone who reaches the
      store planted it).
  """
  key = beside(prefix, OUTCOME)
  secret = _secret.job_secret(op, timeout=1.0, runtime=rt)
  value = outcome + b'|' + str(rt.index).encode()
  if rt.service().kv_create(key, mac(secret, key, value) + value):
    return outcome, rt.index
  stored = rt.service().kv_try_get(key)
  if stored is None or not authentic(secret, key, stored):
    raise failures.forged_message(op, key, me=rt.index)
  decided, _, process = stored[MAC:].partition(b'|')
  try:
    return decided, int(process)
  except ValueError:
    raise failures.forged_message(op, key, me=rt.index) from None


def late_by(marks: list[Mark], start: float) -> float | None:
  """How much later than the last of those that gave up this process started the call.

  By the hosts' wall clocks (each mark holds when its process started);
  None if there is no mark.
  """
  if not marks:
    return None
  return time.time() - (time.monotonic() - start) - max(
      m.started for m in marks)
def named(rt: runtime.Runtime, error: BaseException, op: str, where: str, *,
          waited: float, timeout: float) -> errors.MultihostError:
  """The named error for a coordination-service failure (see `runtime.failures`)."""
  present = None
  if where.endswith('/'):
    present = lambda: published(rt, op, where)  # noqa: E731
  watchdog = rt.watchdog
  error_named = failures.coordination_failure(
      error, op, me=rt.index, count=rt.count, waited=waited, timeout=timeout,
      known=watchdog.known_failure(op, waited=waited, cause=error),
      tasks=coordination.tasks_in(str(error)), published=present,
      source=rt.timeout_source(timeout))
  if isinstance(error_named, errors.ProcessFailureError):
    watchdog.failure_delivered()  # Raised to the program.
  return error_named


def absent(rt: runtime.Runtime, op: str, where: str) -> list[int]:
  """The processes without an authenticated message under `where` (none known if it is no directory)."""
  if not where.endswith('/'):
    return []
  present = set(published(rt, op, where))
  return [p for p in range(rt.count) if p not in present]


def leave_presence(rt: runtime.Runtime, op: str, where: str) -> None:
  """Marks under `where` that this process waits at its barrier (MAC'd; see `published`)."""
  key = where + str(rt.index)
  secret = _secret.job_secret(op, timeout=1.0, runtime=rt)
  rt.service().kv_set(key, mac(secret, key, _HERE_MARK) + _HERE_MARK)


def published(rt: runtime.Runtime, op: str, prefix: str,
              processes: Iterable[int] | None = None) -> list[int]:
  """The processes of `processes` (default: every process of the job) with an authenticated message or presence mark under `prefix` (none if the store is gone).

  A value that fails authentication, or a key of no such process, was
  planted: it does not count, so it cannot hide a missing process.
  """
  try:
    secret = _secret.job_secret(op, timeout=1.0, runtime=rt)
    keys = _keys(rt, prefix, processes)
    return [keys[key] for key, stored in rt.service().kv_dir(prefix)
            if key in keys and authentic(secret, key, stored)]
  except Exception:  # noqa: BLE001
    return []
