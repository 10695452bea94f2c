"""Control plane: the one module that touches JAX's coordination-service client (the one jax._src access).

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
  on a timeout or a failed peer; callers name it, see `_control_rendezvous` and `_diagnostics`.
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


def kv_increment(key: str, by: int) -> int:
  """Atomically adds `by` to the counter at `key` (created at 0); returns the new value."""
  return require_client().key_value_increment(key, by)


def kv_dir(prefix: str) -> list[tuple[str, bytes]]:
  """All (key, value) pairs under `prefix` (which should end with '/')."""
  return require_client().key_value_dir_get_bytes(prefix)


def kv_delete(key: str) -> None:
  """Deletes `key`, or the whole directory when `key` ends with '/'."""
  require_client().key_value_delete(key)


def live_processes(process_ids: list[int]) -> list[int]:
  """The subset of `process_ids` that the coordination service sees alive.

  A rendezvous: the service answers only once every process it considers
  alive has asked too, so every process must poll it (the failure watchdog
  in `_watchdog` does).
  """
  return sorted(require_client().get_live_nodes(list(process_ids)))


# Hosting the service outside the controllers (in a launcher) makes the death
# of process 0 an ordinary peer failure. When process 0 hosts it, the JAX
# client of every other process aborts (SIGABRT) about 1 ms after it goes.


def start_service(address: str, num_processes: int, *,
                  heartbeat_timeout: int, shutdown_timeout: int = 300):
  """Hosts a recoverable coordination service in this process (a launcher).

  The controllers must then call `initialize_without_service` (which
  `multihost.initialize()` does when $MULTIHOST_EXTERNAL_SERVICE=1) with the
  same `heartbeat_timeout`. Call `.shutdown()` on the result once they exit.

  Args:
    address: 'host:port' to listen on.
    num_processes: number of controllers.
    heartbeat_timeout: seconds without heartbeats before a controller is
      declared dead.
    shutdown_timeout: seconds the shutdown barrier may wait.
  """
  from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
  return _jax.get_distributed_runtime_service(
      address, num_processes, heartbeat_timeout=int(heartbeat_timeout),
      shutdown_timeout=int(shutdown_timeout), recoverable=True)


def detect_cluster(coordinator_address: str | None, num_processes: int | None,
                   process_id: int | None,
                   cluster_detection_method: str | None
                   ) -> tuple[str | None, int | None, int | None]:
  """(coordinator address, process count, process index) as `jax.distributed.initialize` would derive them (Slurm, Open MPI, ...)."""
  from jax._src import clusters  # pylint: disable=g-import-not-at-top
  address, count, index, _ = (
      clusters.ClusterEnv.auto_detect_unset_distributed_params(
          coordinator_address, num_processes, process_id, None,
          cluster_detection_method, None))
  return address, count, index


class _NoServiceLib:
  """jaxlib's module as seen by `jax.distributed`, minus the service."""

  def __init__(self, lib):
    self._lib = lib

  def __getattr__(self, name):
    return getattr(self._lib, name)

  def get_distributed_runtime_service(self, *args, **kwargs):
    del args, kwargs
    return None


def initialize_without_service(**kwargs) -> None:
  """`jax.distributed.initialize(**kwargs)`, but process 0 hosts no service.

  For controllers whose coordination service runs elsewhere (see
  `start_service`). `jax.distributed.initialize` always starts the service
  in process 0 and has no option against it, so for the duration of the call
  the jaxlib module it uses answers the service request with None.
  """
  import jax  # pylint: disable=g-import-not-at-top
  lib = _distributed._jax
  _distributed._jax = _NoServiceLib(lib)
  try:
    jax.distributed.initialize(**kwargs)
  finally:
    _distributed._jax = lib


def coordinator_address() -> str | None:
  """'host:port' of the coordination service, or None without jax.distributed."""
  return _distributed.global_state.coordinator_address
