"""sync_global_devices: a named barrier with a timeout."""

from __future__ import annotations

from multihost import _errors
from multihost import _protocol
from multihost import _runtime


def sync_global_devices(name: str, *, timeout: float | None = None) -> None:
  """Blocks until every process reaches the barrier called `name`.

  Collective: every process must call this, in the same order.

  Drop-in for `jax.experimental.multihost_utils.sync_global_devices`: a
  mismatched name raises on every process (a `ConsistencyError`, which is an
  `AssertionError`), naming which processes passed which names. It is a
  coordination-service barrier, not a compiled device collective, so the
  first call costs no compilation, and a process that does not arrive in
  time is named in a `CollectiveTimeoutError` on every other process.

  Args:
    name: the barrier's name; the same on every process.
    timeout: seconds to wait for every process.

  Raises:
    ConsistencyError: processes passed different names.
    CollectiveTimeoutError: a process did not arrive in time (named).
  """
  if not isinstance(name, str):
    raise TypeError(f'sync_global_devices: name must be a str; got {name!r}.')
  timeout = _runtime.resolve_timeout(timeout)
  if _runtime.process_count() == 1:
    return
  headers, agreed = _protocol.exchange(
      _protocol.Header('sync_global_devices', agreed=name), timeout=timeout,
      fast=True, publish=False, read=False)
  if agreed:
    return
  names = [h.agreed for h in headers]
  if len(set(names)) > 1:
    raise _errors.ConsistencyError(
        f'{_runtime.log_prefix()} sync_global_devices name mismatch: '
        f'{_protocol.groups(names)}. Every process must pass the same name '
        'at the same point of the program.')
