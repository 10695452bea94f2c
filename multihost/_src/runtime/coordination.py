"""Runtime: the one module that touches JAX's coordination-service client (the one jax._src access).

Why this module exists: JAX 0.10.2 has no public API for the coordination
service's timed barrier or its key-value store, which are what let a collective
time out and name the processes that did not arrive. The client lives at
`jax._src.distributed.global_state.client` (Orbax and Levanter reach it the same
way). Every other module of `multihost` uses only public JAX APIs and goes
through the small functions here, so a JAX upgrade that moves the client
changes this file alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence
import contextlib
import re
from typing import Protocol
from typing import runtime_checkable
import warnings

from jax._src import distributed as _distributed  # No public client: see above.

from multihost._src.runtime import errors

_TASK_RE = re.compile(r'task:(\d+)')


@runtime_checkable
class Client(Protocol):
  """What the rest of `multihost` needs of the coordination service, per process.

  `JaxClient` is the real one; tests use an in-memory fake
  (tests/fake_coordination.py) whose threads stand for processes. Errors
  are the service's own (on JAX, `jax.errors.JaxRuntimeError`): their text
  starts with the status (`DEADLINE_EXCEEDED`, `NOT_FOUND`, `UNAVAILABLE`)
  and names processes as `task:N`, which `runtime.failures` parses.
  """

  def kv_set(self, key: str, value: bytes) -> None:
    """Sets `key` (replacing any value)."""

  def kv_create(self, key: str, value: bytes) -> bool:
    """Sets `key` only if it is not set (atomically); whether this call set it."""

  def kv_get(self, key: str, timeout: float) -> bytes:
    """The value of `key`, waiting up to `timeout` seconds for it to be set."""

  def kv_try_get(self, key: str) -> bytes | None:
    """The value of `key`, or None when it is not set."""

  def kv_dir(self, prefix: str) -> list[tuple[str, bytes]]:
    """All (key, value) pairs under `prefix` (which should end with '/')."""

  def kv_delete(self, key: str) -> None:
    """Deletes `key`, or the whole directory when `key` ends with '/'."""

  def kv_increment(self, key: str, by: int) -> int:
    """Atomically adds `by` to the counter at `key` (created at 0); returns the new value."""

  def wait_at_barrier(self, barrier_id: str, timeout: float,
                      process_ids: Sequence[int] | None = None) -> None:
    """Blocks until every process (or each of `process_ids`) reaches `barrier_id`.

    On a timeout, raises with `DEADLINE_EXCEEDED` and the processes that did
    not arrive as `task:N`; every process waiting there gets the same error.
    """

  def live_processes(self, process_ids: Sequence[int]) -> list[int]:
    """The subset of `process_ids` that the service sees alive."""


def _ms(timeout: float) -> int:
  return max(1, int(timeout * 1000))


class JaxClient:
  """`Client` on JAX's coordination-service client (`jax.distributed`'s)."""

  __slots__ = ('raw',)

  def __init__(self, raw):
    self.raw = raw

  def kv_set(self, key: str, value: bytes) -> None:
    self.raw.key_value_set_bytes(key, value, allow_overwrite=True)

  def kv_create(self, key: str, value: bytes) -> bool:
    try:
      self.raw.key_value_set_bytes(key, value, allow_overwrite=False)
    except Exception as e:  # noqa: BLE001  The client raises JaxRuntimeError.
      if 'ALREADY_EXISTS' in str(e):
        return False
      raise
    return True

  def kv_get(self, key: str, timeout: float) -> bytes:
    return self.raw.blocking_key_value_get_bytes(key, _ms(timeout))

  def kv_try_get(self, key: str) -> bytes | None:
    try:
      return self.raw.key_value_try_get_bytes(key)
    except Exception as e:  # noqa: BLE001  The client raises JaxRuntimeError.
      if 'NOT_FOUND' in str(e):
        return None
      raise

  def kv_dir(self, prefix: str) -> list[tuple[str, bytes]]:
    return self.raw.key_value_dir_get_bytes(prefix)

  def kv_delete(self, key: str) -> None:
    self.raw.key_value_delete(key)

  def kv_increment(self, key: str, by: int) -> int:
    return self.raw.key_value_increment(key, by)

  def wait_at_barrier(self, barrier_id: str, timeout: float,
                      process_ids: Sequence[int] | None = None) -> None:
    if process_ids is None:
      self.raw.wait_at_barrier(barrier_id, _ms(timeout))
    else:
      self.raw.wait_at_barrier(barrier_id, _ms(timeout), list(process_ids))

  def live_processes(self, process_ids: Sequence[int]) -> list[int]:
    # A rendezvous: the service answers only once every process it considers
    # alive has asked too, so every process must poll it (the failure
    # watchdog in `liveness.watchdog` does).
    return sorted(self.raw.get_live_nodes(list(process_ids)))


def raw_client():
  """JAX's own client object, or None without jax.distributed (compared by identity)."""
  return _distributed.global_state.client


def client() -> JaxClient | None:
  """The coordination-service client of `jax.distributed`, or None without it."""
  raw = _distributed.global_state.client
  return None if raw is None else JaxClient(raw)


def require_client() -> JaxClient:
  c = client()
  if c is None:
    raise errors.NotInitializedError(
        'jax.distributed is not initialized, so there is no coordination '
        'service. Call multihost.initialize() (or jax.distributed.initialize())'
        ' at the start of your program, before any other JAX call.')
  return c


def runs_service() -> bool:
  """True on the process that runs the coordination service (process 0, by JAX's default)."""
  return _distributed.global_state.service is not None


def tasks_in(message: str) -> list[int]:
  """Process indices named as `task:N` in a coordination-service error."""
  return sorted({int(m) for m in _TASK_RE.findall(message)})


# The same calls on `jax.distributed`'s client, for the seams in `lowlevel`.


def wait_at_barrier(barrier_id: str, timeout: float,
                    process_ids: list[int] | None = None) -> None:
  require_client().wait_at_barrier(barrier_id, timeout, process_ids)


def kv_set(key: str, value: bytes) -> None:
  require_client().kv_set(key, value)


def kv_get(key: str, timeout: float) -> bytes:
  return require_client().kv_get(key, timeout)


def kv_dir(prefix: str) -> list[tuple[str, bytes]]:
  return require_client().kv_dir(prefix)


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


@contextlib.contextmanager
def kubernetes_warning_hidden() -> Iterator[None]:
  """Hides JAX's warning that a pod lacks the `kubernetes` package.

  JAX's detection gives it in every pod without the package, also when
  the coordinator, count and index are given (`multihost.initialize()`
  raises its own error where the package is needed).
  """
  with warnings.catch_warnings():
    warnings.filterwarnings(
        'ignore', 'Kubernetes environment detected, but the `kubernetes`',
        UserWarning)
    yield


def detect_cluster(coordinator_address: str | None, num_processes: int | None,
                   process_id: int | None,
                   local_device_ids: Sequence[int] | None,
                   cluster_detection_method: str | None, *, timeout: float
                   ) -> tuple[str | None, int | None, int | None,
                              list[int] | None]:
  """(coordinator address, process count, process index, local device ids) as `jax.distributed.initialize` would derive them; those given kept.

  JAX's own cluster detection (`clusters.jax_detection` is its one
  caller): with `cluster_detection_method`, that cluster type's; else the
  first JAX finds. `timeout`: seconds a detection may wait (Kubernetes'
  and a TPU VM's lookups).
  """
  from jax._src import clusters  # pylint: disable=g-import-not-at-top
  with kubernetes_warning_hidden():
    address, count, index, local = (
        clusters.ClusterEnv.auto_detect_unset_distributed_params(
            coordinator_address, num_processes, process_id,
            None if local_device_ids is None else list(local_device_ids),
            cluster_detection_method, max(1, int(timeout))))
  return address, count, index, None if local is None else list(local)


def running_on_cloud_tpu_vm() -> bool:
  """Whether JAX found this machine to be a Cloud TPU VM (where its cluster detection restricts no process to a device)."""
  from jax._src import cloud_tpu_init  # pylint: disable=g-import-not-at-top
  return bool(cloud_tpu_init.running_in_cloud_tpu_vm)


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


def backends_started() -> bool:
  """Whether JAX has created its backends (and with them its thread pools)."""
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  return xla_bridge.backends_are_initialized()
