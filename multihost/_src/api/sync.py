"""Public collective: sync_global_devices, a named barrier with a timeout."""

from __future__ import annotations

from multihost._src.control import agree
from multihost._src.diagnostics import metrics
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import process


@metrics.recorded('sync_global_devices')
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
  timeout = process.resolve_timeout(timeout)
  if process.process_count() == 1:
    return
  try:
    headers = agree.agree(
        agree.Header('sync_global_devices', name=name),
        timeout=timeout).headers
  except errors.MultihostError as e:  # Name the barrier.
    raise failures.retell(e, failures.name_barrier(str(e), name)) from e
  if headers is None:
    return
  names = [h.name for h in headers]
  if len(set(names)) > 1:
    raise errors.ConsistencyError(
        f'{failures.prefix()} sync_global_devices name mismatch: '
        f'{failures.groups(names)}. Every process must pass the same name '
        'at the same point of the program.')
