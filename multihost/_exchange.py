"""Small-message all-gather through the coordination service, with a timeout.

This is the rendezvous every collective starts with: each process publishes a
small message (what it is about to do, and for small payloads the payload
itself), waits at a timed barrier, and reads everyone's message. A process
that does not arrive in time is named in the exception raised on every
process that did; processes never enter a device collective that a peer
will not join with the same shapes.
"""

from __future__ import annotations

import time

from multihost import _coordination
from multihost import _errors
from multihost import _failure
from multihost import _runtime

_ROOT = 'multihost'
# Calls are grouped in blocks of this many; process 0 deletes a whole block's
# keys once every process is two blocks further, so the store stays small.
_BLOCK = 64


def allgather_bytes(op: str, payload: bytes, *, timeout: float) -> list[bytes]:
  """Gathers one bytes message from every process, in process order.

  Collective: every process must call this, in the same order.

  Args:
    op: the operation's name, used in error messages.
    payload: this process's message.
    timeout: seconds to wait for every process.

  Returns:
    A list with one message per process, indexed by process.

  Raises:
    CollectiveTimeoutError: a process did not arrive in time (named).
    ProcessFailureError: the coordination service reports a peer gone.
  """
  count = _runtime.process_count()
  if count == 1:
    return [payload]
  me = _runtime.process_index()
  call = _runtime.next_call_id()
  prefix = f'{_ROOT}/{call // _BLOCK}/{call}/'
  _coordination.kv_set(prefix + str(me), payload)
  barrier(prefix, op, timeout=timeout, call=call)
  messages: list[bytes | None] = [None] * count
  for key, value in _coordination.kv_dir(prefix):
    messages[int(key.rsplit('/', 1)[1])] = value
  if me == 0 and call % _BLOCK == 0 and call >= 2 * _BLOCK:
    _coordination.kv_delete(f'{_ROOT}/{call // _BLOCK - 2}/')
  missing = [p for p, m in enumerate(messages) if m is None]
  if missing:  # Cannot happen after a completed barrier; never hide it.
    raise _errors.MultihostError(
        f'{_runtime.log_prefix()} {op}: the barrier completed but the '
        f'messages of processes {missing} are missing from the '
        'coordination service. This is a bug in multihost; please report it.')
  return messages  # type: ignore[return-value]


def barrier(barrier_id: str, op: str, *, timeout: float,
            call: int | None = None) -> None:
  """Waits at a coordination-service barrier, translating its failures.

  Collective: every process must call this, in the same order.

  Raises:
    CollectiveTimeoutError: naming the processes that did not arrive.
    ProcessFailureError: naming processes the service reports as gone.
  """
  start = time.monotonic()
  try:
    _coordination.wait_at_barrier(barrier_id, timeout)
  except Exception as e:  # The client raises JaxRuntimeError. # noqa: BLE001
    waited = time.monotonic() - start
    raise translate_failure(e, op, barrier_id, waited=waited,
                            timeout=timeout) from e


def translate_failure(error: BaseException, op: str, where: str, *,
                      waited: float, timeout: float) -> _errors.MultihostError:
  """Turns a coordination-service error into a named multihost exception.

  It makes no blocking call: which peers are gone comes from the failure
  watchdog (`_failure`), or from the error's own text.
  """
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
