"""Control plane: the rendezvous of every process through the coordination service (timed barriers, key-value store).

A `Rendezvous` is one numbered meeting; its steps are named for what they do:
`try_agreement` is the fast path, one timed barrier whose id carries a digest
of what every process must agree on (small payloads published in the
key-value store beside it, then `read_all` or `read_one`); `exchange` is the
full exchange (when the fast path does not complete within a second, or is
not tried): each process publishes its message, waits at a timed barrier and
reads everyone's. A process that does not arrive in time is named in the
exception raised on every process that did; processes never start moving
data that a peer will not receive with the same shapes.
"""

from __future__ import annotations

import functools
import hmac
import time

from multihost._src.auth import marks
from multihost._src.auth import secret as _secret
from multihost._src.control import links
from multihost._src.control import rounds
from multihost._src.diagnostics import stalls
from multihost._src.diagnostics import where as _where
from multihost._src.liveness import blocking
from multihost._src.runtime import coordination
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import runtime as _runtime

_ROOT = 'multihost'
# Calls are grouped in blocks of this many; a block's keys are deleted once
# every process is two blocks further, so the store stays small: by process
# 0 where the block's calls met through the service (every process may have
# written), and by each process that wrote keys in it otherwise (diagnosis,
# gave-up marks, a full exchange). Calls that agree over the links write no
# keys, so they cost no deleting RPC.
_BLOCK = 64
# The fast path waits this long at its barrier before falling back to the
# full exchange. The service checks barrier deadlines about once a second,
# so a shorter window would not fail faster.
FAST_WINDOW_S = 1.0
# After a fallback, this many calls take the full exchange directly: a peer
# that runs more than the window behind then costs one window, not one per
# call. Every process counts the same calls, so they all agree on the path.
# (The count left is the runtime's `backoff`.)
_BACKOFF_CALLS = 8
# The runtime's `last_end` is when this process's last call ended. A process
# that starts a call more than the fast window after that may be the one the
# others waited for: it first reads whether they already fell back (one
# read, only then), and if so joins their full exchange at once instead of
# waiting out a window at a barrier no one else will reach.

_FELL_BACK = b'F'
_DIRECT = b'D'
# Barrier ids cycle through this many slots, so that the service, which
# keeps every barrier id it saw, holds a bounded set. Call c and c + _CYCLE
# share a slot; they cannot meet there: every call needs every process, so
# no process runs _CYCLE calls ahead of another.
_CYCLE = 4 * _BLOCK


def _ends_on_error(step):
  """A step of `Rendezvous` whose exception also ends the call's flight record.

  So that a process that raised is no longer reported as waiting in the
  call, and its exit handshake knows its last call failed (see `liveness.exit_handshake`).
  """

  @functools.wraps(step)
  def wrapped(self, *args, **kwargs):
    try:
      return step(self, *args, **kwargs)
    except BaseException as e:
      self.rt.flight.fail(self.record, e)
      self.rt.met_start = None
      raise

  return wrapped


class Rendezvous:
  """One numbered meeting of every process, keyed by its call number.

  Collective: every process must start one, in the same order, and take the
  same steps: `try_agreement` (optional), then `read_all`/`read_one` if it
  returned True, else `exchange`.
  """

  __slots__ = ('rt', 'client', 'op', 'me', 'count', 'call', 'start',
               '_may_agree', '_fell_back', '_window', 'record', '_links',
               '_entries')

  def __init__(self, rt: _runtime.Runtime, op: str, name: str = ''):
    self.rt = rt
    self.client: coordination.Client = (
        rt.client or coordination.require_client())
    rt.watchdog.check(op)  # A peer known to be gone: raise at once.
    self.op = op
    self.me = rt.index
    self.count = rt.count
    self.call = rt.next_call_id()
    self.start = time.monotonic()
    self.record = rt.flight.begin(op, self.call, self.start, name)
    rt.where.ensure_started()
    self._may_agree = rt.backoff == 0
    rt.backoff = max(0, rt.backoff - 1)
    self._fell_back = False
    self._window = FAST_WINDOW_S
    # Over the links once every process set them up (see `control.links`).
    self._links = links.usable(rt)
    self._entries: dict[int, bytes] | None = None
    if not self._links:
      if self.me == 0:  # Process 0 deletes the service path's blocks.
        self.wrote()
      if links.enabled(rt):
        links.prepare(rt, op, self.call)

  @property
  def prefix(self) -> str:
    """The call's key directory in the key-value store (made when asked: a call that agrees over the links never does)."""
    return f'{_ROOT}/{self.call // _BLOCK}/{self.call}/'

  @property
  def _slot(self) -> str:
    """The call's barrier slot (the service's path)."""
    return f'{_ROOT}/b{self.call % _CYCLE}/'

  def wrote(self) -> None:
    """Notes that this process writes keys of this call (deleted with its block, see `_ended`)."""
    self.rt.written_blocks.add(self.call // _BLOCK)

  @_ends_on_error
  def try_agreement(self, agreement: bytes, *, timeout: float,
                    publish: bytes | None = None, eager=None,
                    relay=None) -> bool:
    """Whether every process passed the same `agreement` bytes (one barrier).

    `publish` (if given) is put in the key-value store first, for
    `read_all`/`read_one`. Returns False at once while backing off after a
    recent fallback, or after FAST_WINDOW_S when a peer is slow or disagrees;
    then call `exchange`. `eager` (a broadcast source's
    `transport.tcp.eager.Eager`) starts during an agreement over the links, and is
    left unstarted on the service's path; `relay` (a broadcast's
    `transport.tcp.tree.Relay`) is the links' too.

    Raises:
      ProcessFailureError: a peer is gone.
    """
    if self._links:
      self._entries = rounds.agree(self, agreement, publish,
                                  timeout=timeout, eager=eager, relay=relay)
      if self._entries is None:  # A difference: the full exchange names it.
        return False
      self.record.end = time.monotonic()
      self._ended()
      return True
    if not self._may_agree:
      return False
    if self._late_to_a_fallback():
      self._fell_back = True
      return False
    if publish is not None:
      self._publish(_DIRECT + publish, timeout)
    window = self._window = min(FAST_WINDOW_S, timeout)
    try:
      # Directly, not under the failure watchdog: the window bounds it,
      # and a failed peer is then caught by the full exchange.
      self.client.wait_at_barrier(f'{self._slot}a{agreement.hex()}', window)
    except Exception as e:  # The client raises JaxRuntimeError. # noqa: BLE001
      failure = marks.named(self.rt, e, self.op, self.prefix,
                       waited=time.monotonic() - self.start, timeout=timeout)
      if isinstance(failure, errors.ProcessFailureError):
        raise failure from e
      self._fell_back = True
      return False
    self.record.end = time.monotonic()
    self._ended()
    return True

  @_ends_on_error
  def read_all(self) -> list[bytes]:
    """After agreement: what each process published (every process did)."""
    if self._entries is not None:
      missing = [p for p in range(self.count) if p not in self._entries]
      if missing:  # Cannot happen after an agreement; never hide it.
        raise failures.messages_missing(self.op, missing, me=self.me)
      return [self._entries[p] for p in range(self.count)]
    return [m[1:] for m in self._read_everyone()]

  @_ends_on_error
  def read_one(self, process: int) -> bytes:
    """After agreement: what `process` published."""
    if self._entries is not None:
      if process not in self._entries:
        raise failures.messages_missing(self.op, [process], me=self.me)
      return self._entries[process]
    key = self.prefix + str(process)
    return self._open(key, self.client.kv_get(key, self._window))[1:]

  @_ends_on_error
  def exchange(self, message: bytes, *, timeout: float) -> list[bytes]:
    """The full exchange: publishes `message`, meets everyone, reads all messages.

    Raises:
      CollectiveTimeoutError: a process did not arrive in time (named).
      ProcessFailureError: a peer is gone.
    """
    rt = self.rt
    flag = _FELL_BACK if self._fell_back else _DIRECT
    self._publish(flag + message, timeout)
    waited = time.monotonic() - self.start
    # A process that timed out here leaves a mark, so that a latecomer
    # raises at once instead of waiting its whole timeout at a barrier no
    # one else will reach: it is then in step again for the next call.
    # Either way the next calls take the full exchange directly: a
    # latecomer then meets the others without another fast-path window.
    gave_up = marks.gave_up(rt, self.op, self.prefix)
    if gave_up:
      rt.backoff = _BACKOFF_CALLS
      raise failures.arrived_late(
          self.op, me=self.me, waited=waited, timeout=timeout,
          late_by=marks.late_by(gave_up, self.start),
          source=rt.timeout_source(timeout))
    # The whole time left: the service fails a barrier up to a second after
    # its deadline, never before, so a timeout is never early.
    remaining = timeout - waited
    try:
      barrier(self._slot + 's', self.op, timeout=max(remaining, 0.001),
              waited_before=waited, total_timeout=timeout,
              published=self.prefix, runtime=rt)
    except errors.CollectiveTimeoutError:
      rt.backoff = _BACKOFF_CALLS
      self.wrote()
      marks.leave_mark(rt, self.op, self.prefix, self.start)
      raise
    self.record.end = time.monotonic()
    messages = self._read_everyone()
    if any(m[:1] == _FELL_BACK for m in messages):
      rt.backoff = _BACKOFF_CALLS
    self._ended()
    return [m[1:] for m in messages]

  def _late_to_a_fallback(self) -> bool:
    """Whether this process, come late, finds the others in the exchange."""
    last_end = self.rt.last_end
    if last_end is not None and self.start - last_end <= FAST_WINDOW_S:
      return False
    try:
      messages = self._read(flags=True)
    except Exception:  # noqa: BLE001
      # E.g. a forged message: the read after the barrier raises it on every
      # process, so that every process names it; here it only says "go on".
      return False
    return any(m is not None and m[:1] == _FELL_BACK
               for p, m in enumerate(messages) if p != self.me)

  def _ended(self) -> None:
    """Once every process met: drops old keys, notes when (`last_end`)."""
    call = self.call
    written = self.rt.written_blocks
    if written:  # Every process started this call: none is in those blocks.
      for block in [b for b in written if b <= call // _BLOCK - 2]:
        written.discard(block)
        self.client.kv_delete(f'{_ROOT}/{block}/')
    self.rt.last_end = time.monotonic()
    self.rt.met_start = self.start
    if not self._links and links.enabled(self.rt):
      links.met(self.rt, self.op, call)

  def _publish(self, value: bytes, timeout: float) -> None:
    """Puts `value` under this process's key, authenticated with the job secret."""
    key = self.prefix + str(self.me)
    secret = _secret.job_secret(self.op, timeout=timeout, runtime=self.rt)
    self.wrote()
    self.client.kv_set(key, marks.mac(secret, key, value) + value)

  def _open(self, key: str, stored: bytes) -> bytes:
    """The value under `key`, if a process of this job wrote it there; else raises."""
    secret = _secret.job_secret(self.op, timeout=1.0, runtime=self.rt)
    value = stored[marks.MAC:]
    if len(stored) < marks.MAC + 1 or not hmac.compare_digest(
        stored[:marks.MAC], marks.mac(secret, key, value)):
      raise failures.forged_message(self.op, key, me=self.me)
    return value

  def _read_everyone(self) -> list[bytes]:
    """After a completed barrier: every process's message, flag included."""
    messages = self._read(flags=True)
    missing = [p for p, m in enumerate(messages) if m is None]
    if missing:  # Cannot happen after a completed barrier; never hide it.
      raise failures.messages_missing(self.op, missing, me=self.me)
    return [m for m in messages if m is not None]  # all of them

  def _read(self, flags: bool = False) -> list[bytes | None]:
    """Each process's authenticated message under the call's prefix (None: none yet).

    Only the keys `prefix + str(p)` of processes 0..count-1 are read; any
    other key under the prefix was planted there, and raises.
    """
    prefix = self.prefix
    messages: list[bytes | None] = [None] * self.count
    expected = {prefix + str(p): p for p in range(self.count)}
    for key, stored in self.client.kv_dir(prefix):
      if key not in expected:
        raise failures.forged_message(self.op, key, planted=True,
                                          me=self.me)
      value = self._open(key, stored)
      messages[expected[key]] = value if flags else value[1:]
    return messages


def barrier(barrier_id: str, op: str, *, timeout: float,
            waited_before: float = 0.0, total_timeout: float | None = None,
            published: str | None = None,
            runtime: _runtime.Runtime | None = None) -> None:
  """Waits at a coordination-service barrier, watched, with its failures named.

  Collective: every process must call this, in the same order.

  Args:
    barrier_id: the barrier; when it ends with '/', also the key directory
      in which the processes published (to name those that did not).
    op: the collective, for messages.
    timeout: seconds to wait here.
    waited_before: seconds the collective already waited.
    total_timeout: the collective's whole timeout (default: `timeout`).
    published: the key directory in which the processes published.
    runtime: the process's runtime (default: the current one).

  Raises:
    CollectiveTimeoutError: naming the processes that did not arrive.
    ProcessFailureError: naming processes the service reports as gone.
  """
  rt = runtime or _runtime.current()
  client = rt.service()
  start = time.monotonic()
  where = published or barrier_id
  stall = stalls.arm(  # The slow path: a lock, no RPC.
      op, started=start - waited_before, until=start + timeout,
      missing=lambda: marks.absent(rt, op, where), runtime=rt)
  try:
    # In a step thread, so that a peer's death raises here within the
    # failure watchdog's bound instead of after `timeout` (see `liveness.watchdog`).
    blocking.call(op, client.wait_at_barrier, barrier_id, timeout,
                   runtime=rt)
  except Exception as e:  # The client raises JaxRuntimeError. # noqa: BLE001
    stalls.disarm(stall, runtime=rt)
    raise _where.with_whereabouts(marks.named(
        rt, e, op, where,
        waited=time.monotonic() - start + waited_before,
        timeout=timeout if total_timeout is None else total_timeout),
        runtime=rt) from e
  stalls.disarm(stall, runtime=rt)
