"""The rendezvous every collective starts with, through the coordination service.

Fast path: one timed barrier whose id carries a digest of what every process
must agree on (see `rendezvous`); small payloads are published in the
key-value store beside it. Full exchange (when the fast path does not
complete within a second): each process publishes its message, waits at a
timed barrier and reads everyone's. A process that does not arrive in time
is named in the exception raised on every process that did; processes never
start moving data that a peer will not receive with the same shapes.
"""

from __future__ import annotations

from collections.abc import Callable
import time

from multihost import _coordination
from multihost import _errors
from multihost import _failure
from multihost import _runtime

_ROOT = 'multihost'
# Calls are grouped in blocks of this many; process 0 deletes a whole block's
# keys once every process is two blocks further, so the store stays small.
_BLOCK = 64
# The fast path waits this long at its barrier before falling back to the
# full exchange. The service checks barrier deadlines about once a second,
# so a shorter window would not fail faster.
FAST_WINDOW_S = 1.0
# After a fallback, this many calls take the full exchange directly: a peer
# that runs more than the window behind then costs one window, not one per
# call. Every process counts the same calls, so they all agree on the path.
_BACKOFF_CALLS = 8
_backoff = 0

_FELL_BACK = b'F'
_DIRECT = b'D'


def rendezvous(op: str, message: bytes | Callable[[], bytes], *,
               timeout: float,
               agreement: bytes | None = None, publish: bool = True,
               read: bool | int = True, fast_message: bytes | None = None
               ) -> tuple[list[bytes | None] | None, bool]:
  """Meets every process; returns (messages, whether the fast path agreed).

  `message` may be a function that makes it: it is then called only when the
  full exchange needs it.

  Collective: every process must call this, in the same order.

  Fast path (`agreement` given): one coordination-service barrier whose id
  carries `agreement`, so it completes only if every process passed the same
  bytes; `fast_message` (default: `message`) is published first only if
  `publish`, and everyone's published messages are read only if `read` (an
  int: only that process's message). If the barrier does not
  complete within FAST_WINDOW_S (a slow peer, or a disagreement), every
  process falls back to the full exchange: publish, wait at a plain barrier
  for the rest of `timeout`, read all messages. The full exchange is what
  names missing processes and lets callers describe disagreements.

  Returns:
    (messages, agreed). After the fast path, agreed is True and messages is
    None unless `read` (then a list with what each process published, None
    for those that published nothing). After the full exchange, agreed is
    False and messages has one message per process.

  Raises:
    CollectiveTimeoutError: a process did not arrive in time (named).
    ProcessFailureError: the coordination service reports a peer gone.
  """
  global _backoff
  count = _runtime.process_count()
  if count == 1:
    return [message if isinstance(message, bytes) else message()], (
        agreement is not None)
  _failure.check(op)  # A peer known to be gone: raise at once.
  me = _runtime.process_index()
  call = _runtime.next_call_id()
  prefix = f'{_ROOT}/{call // _BLOCK}/{call}/'
  start = time.monotonic()
  fast = agreement is not None and _backoff == 0
  _backoff = max(0, _backoff - 1)
  published = False
  fell_back = False
  if fast:
    if publish:
      _coordination.kv_set(prefix + str(me), _DIRECT + (
          _bytes(message) if fast_message is None else fast_message))
      published = True
    window = min(FAST_WINDOW_S, timeout)
    try:
      # Directly, not under the failure watchdog: the window bounds it,
      # and a failed peer is then caught by the full exchange below.
      _coordination.wait_at_barrier(f'{prefix}a{agreement.hex()}', window)
    except Exception as e:  # The client raises JaxRuntimeError. # noqa: BLE001
      failure = translate_failure(e, op, prefix, waited=time.monotonic() - start,
                                  timeout=timeout)
      if isinstance(failure, _errors.ProcessFailureError):
        raise failure from e
      fell_back = True
    else:
      _cleanup(call, me)
      if read is True:
        return _read(prefix, count), True
      if read is False:
        return None, True
      one: list[bytes | None] = [None] * count
      one[read] = _coordination.kv_get(prefix + str(read), window)[1:]
      return one, True
  if not published or fell_back or fast_message is not None:
    flag = _FELL_BACK if fell_back else _DIRECT
    _coordination.kv_set(prefix + str(me), flag + _bytes(message))
  remaining = timeout - (time.monotonic() - start)
  barrier(prefix + 's', op, timeout=max(remaining, 0.001), call=call,
          waited_before=time.monotonic() - start, total_timeout=timeout,
          published=prefix)
  messages = _read(prefix, count, flags=True)
  missing = [p for p, m in enumerate(messages) if m is None]
  if missing:  # Cannot happen after a completed barrier; never hide it.
    raise _errors.MultihostError(
        f'{_runtime.log_prefix()} {op}: the barrier completed but the '
        f'messages of processes {missing} are missing from the '
        'coordination service. This is a bug in multihost; please report it.')
  if any(m[:1] == _FELL_BACK for m in messages):
    _backoff = _BACKOFF_CALLS
  _cleanup(call, me)
  return [m[1:] for m in messages], False


def _bytes(message: bytes | Callable[[], bytes]) -> bytes:
  return message if isinstance(message, bytes) else message()


def _read(prefix: str, count: int, flags: bool = False) -> list[bytes | None]:
  messages: list[bytes | None] = [None] * count
  for key, value in _coordination.kv_dir(prefix):
    name = key.rsplit('/', 1)[1]
    if name.isdigit():
      messages[int(name)] = value if flags else value[1:]
  return messages


def _cleanup(call: int, me: int) -> None:
  if me == 0 and call % _BLOCK == 0 and call >= 2 * _BLOCK:
    _coordination.kv_delete(f'{_ROOT}/{call // _BLOCK - 2}/')


def barrier(barrier_id: str, op: str, *, timeout: float,
            call: int | None = None, waited_before: float = 0.0,
            total_timeout: float | None = None,
            published: str | None = None) -> None:
  """Waits at a coordination-service barrier, translating its failures.

  Collective: every process must call this, in the same order.

  Raises:
    CollectiveTimeoutError: naming the processes that did not arrive.
    ProcessFailureError: naming processes the service reports as gone.
  """
  del call
  start = time.monotonic()
  try:
    # In a worker thread, so that a peer's death raises here within the
    # failure watchdog's bound instead of after `timeout` (see `_failure`).
    _failure.call(op, _coordination.wait_at_barrier, barrier_id, timeout)
  except Exception as e:  # The client raises JaxRuntimeError. # noqa: BLE001
    waited = time.monotonic() - start + waited_before
    raise translate_failure(
        e, op, published or barrier_id, waited=waited,
        timeout=timeout if total_timeout is None else total_timeout) from e


def translate_failure(error: BaseException, op: str, where: str, *,
                      waited: float, timeout: float) -> _errors.MultihostError:
  """Turns a coordination-service error into a named multihost exception.

  It makes no blocking call: which peers are gone comes from the failure
  watchdog (`_failure`), or from the error's own text.
  """
  if isinstance(error, _errors.MultihostError):  # Already named (_failure).
    return error
  me = _runtime.process_index()
  message = str(error)
  if _failure.failed_processes():
    return _failure.failure_error(op, waited=waited, cause=error)
  if 'UNAVAILABLE' in message and ('coordination service' in message or
                                   'failed to connect' in message):
    return _errors.ProcessFailureError(
        f'[process={me}] {op}: the coordination service (hosted by process '
        f'0) is unreachable after {waited:.1f} s; process 0 has probably '
        f'failed. Underlying error: {_short(message)}',
        operation=op, failed=[0])
  if 'heartbeat' in message or 'unhealthy' in message:
    dead = [t for t in _coordination.tasks_in(message) if t != me]
    return _errors.ProcessFailureError(
        f'[process={me}] {op}: process(es) {dead} failed (the coordination '
        f'service reports missed heartbeats) after {waited:.1f} s. The '
        'collective cannot complete; save what you can and restart the job.',
        operation=op, failed=dead)
  count = _runtime.process_count()
  everyone = list(range(count))
  missing = [t for t in _coordination.tasks_in(message) if t != me]
  if not missing and where.endswith('/'):
    present = {int(k.rsplit('/', 1)[1])
               for k, _ in _safe_dir(where)}
    missing = [p for p in everyone if p not in present]
  if 'DEADLINE_EXCEEDED' in message or waited >= timeout * 0.99:
    if not missing:
      return _errors.CollectiveTimeoutError(
          f'[process={me}] {op}: this process arrived late: the other '
          f'processes had already given up waiting (timeout={timeout:g} s) '
          f'when it got there after {waited:.1f} s more. Find what delayed '
          f'process {me}, or pass a larger timeout=.',
          operation=op, missing=[me], waited=waited)
    who = f'process(es) {missing}'
    return _errors.CollectiveTimeoutError(
        f'[process={me}] {op}: timed out after {waited:.1f} s (timeout='
        f'{timeout:g} s) waiting for {who} to arrive. Check that every '
        'process calls the same collectives in the same order, or pass a '
        'larger timeout= (or multihost.set_default_timeout()).',
        operation=op, missing=missing, waited=waited)
  return _errors.MultihostError(
      f'[process={me}] {op}: the coordination-service barrier failed after '
      f'{waited:.1f} s: {_short(message)}')


def _safe_dir(prefix: str) -> list[tuple[str, bytes]]:
  try:
    return _coordination.kv_dir(prefix)
  except Exception:  # noqa: BLE001
    return []


def _short(message: str, limit: int = 400) -> str:
  message = ' '.join(message.split())
  return message if len(message) <= limit else message[:limit] + '...'
