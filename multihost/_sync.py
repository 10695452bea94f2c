"""Public collective: sync_global_devices, a named barrier with a timeout."""

from __future__ import annotations

from multihost import _control_agree
from multihost import _diagnostics
from multihost import _errors
from multihost import _metrics
from multihost import _process


@_metrics.recorded('sync_global_devices')
def sync_global_devices(name: str, *, timeout: float | None = None) -> None:
  """Blocks until every process reaches the barrier called `name`.

  Collective: every process must call this, in the same order.

  Drop-in for `jax.experimental.multihost_utils.sync_global_devices`: a
  mismatched name raises on every process (a `ConsistencyError`, which is an
  `AssertionError`), naming which processes passed which names. It is an
  agreement of the control plane (rounds over the job's authenticated TCP
  links, or a coordination-service barrier where those are not up), not a
  compiled device collective, so the first call costs no compilation, and a
  process that does not arrive in time is named in a
  `CollectiveTimeoutError` on every other process.

  Args:
    name: the barrier's name; the same on every process.
    timeout: seconds to wait for every process.

  Raises:
    ConsistencyError: processes passed different names.
    CollectiveTimeoutError: a process did not arrive in time (named).
  """
  if not isinstance(name, str):
    raise TypeError(f'sync_global_devices: name must be a str; got {name!r}.')
  timeout = _process.resolve_timeout(timeout)
  if _process.process_count() == 1:
    return
  try:
    headers = _control_agree.agree(
        _control_agree.Header('sync_global_devices', name=name),
        timeout=timeout).headers
  except _errors.MultihostError as e:  # Name the barrier.
    raise _diagnostics.retell(e, _diagnostics.name_barrier(str(e), name)) from e
  if headers is None:
    return
  names = [h.name for h in headers]
  if len(set(names)) > 1:
    raise _errors.ConsistencyError(
        f'{_diagnostics.prefix()} sync_global_devices name mismatch: '
        f'{_diagnostics.groups(names)}. Every process must pass the same name '
        'at the same point of the program.')
