"""The one module that touches JAX's coordination-service client.

Why this module exists: JAX 0.10.2 has no public API for the coordination
service's timed barrier or its key-value store, which are what let a collective
time out and name the processes that did not arrive. The client lives at
`jax._src.distributed.global_state.client` (Orbax and Levanter reach it the same
way). Every other module of `multihost` uses only public JAX APIs and goes
through the small functions here, so a JAX upgrade that moves the client
changes this file alone.
"""

from __future__ import annotations

import re

from jax._src import distributed as _distributed  # No public client: see above.

from multihost import _errors

_TASK_RE = re.compile(r'task:(\d+)')


def client():
  """Returns the coordination-service client, or None without jax.distributed."""
  return _distributed.global_state.client


def require_client():
  c = client()
  if c is None:
    raise _errors.NotInitializedError(
        'jax.distributed is not initialized, so there is no coordination '
        'service. Call multihost.initialize() (or jax.distributed.initialize())'
        ' at the start of your program, before any other JAX call.')
  return c


def hosts_service() -> bool:
  """True on the process that hosts the coordination service (process 0)."""
  return _distributed.global_state.service is not None


def tasks_in(message: str) -> list[int]:
  """Process indices named as `task:N` in a coordination-service error."""
  return sorted({int(m) for m in _TASK_RE.findall(message)})


def wait_at_barrier(barrier_id: str, timeout_s: float,
                    process_ids: list[int] | None = None) -> None:
  """Blocks until every process (or `process_ids`) reaches `barrier_id`.

  Raises the client's own exception (usually `jax.errors.JaxRuntimeError`)
  on a timeout or a failed peer; callers translate it, see `_exchange`.
  """
  ms = max(1, int(timeout_s * 1000))
  if process_ids is None:
    require_client().wait_at_barrier(barrier_id, ms)
  else:
    require_client().wait_at_barrier(barrier_id, ms, list(process_ids))


def kv_set(key: str, value: bytes) -> None:
  require_client().key_value_set_bytes(key, value, allow_overwrite=True)


def kv_get(key: str, timeout_s: float) -> bytes:
  return require_client().blocking_key_value_get_bytes(
      key, max(1, int(timeout_s * 1000)))


def kv_try_get(key: str) -> bytes | None:
  try:
    return require_client().key_value_try_get_bytes(key)
  except Exception:  # NOT_FOUND is reported as an exception.  # noqa: BLE001
    return None


def kv_dir(prefix: str) -> list[tuple[str, bytes]]:
  """All (key, value) pairs under `prefix` (which should end with '/')."""
  return require_client().key_value_dir_get_bytes(prefix)


def kv_delete(key: str) -> None:
  """Deletes `key`, or the whole directory when `key` ends with '/'."""
  require_client().key_value_delete(key)


def live_processes(process_ids: list[int]) -> list[int]:
  """The subset of `process_ids` that the coordination service sees alive."""
  return sorted(require_client().get_live_nodes(list(process_ids)))
