"""Public function: `initialize()`, which brings up `jax.distributed`, builds the runtime on its client and starts the failure watchdog."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
import os
import socket
import time
from typing import Any

from absl import logging
import jax

from multihost import env as _env
from multihost._src.auth import secret
from multihost._src.clusters import chain
from multihost._src.clusters import job as job_lib
from multihost._src.clusters import kubernetes
from multihost._src.runtime import companion as _companion
from multihost._src.runtime import coordination
from multihost._src.runtime import failures
from multihost._src.runtime import runtime
from multihost._src.runtime import settings


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None,
               local_device_ids: int | Sequence[int] | None = None,
               cluster_detection_method: str | None = None,
               initialization_timeout: int = 300,
               heartbeat_timeout_seconds: int | None = None,
               shutdown_timeout_seconds: int = 300,
               coordinator_bind_address: str | None = None,
               slice_index: int | None = None,
               partition_index: int | None = None,
               *,
               detect_failures: bool | None = None) -> None:
  """Initializes `jax.distributed`; safe to call when it is already initialized.

  Takes every argument of `jax.distributed.initialize`, by the same name and
  position; its own options are keyword-only. Arguments are taken, in
  order, from: this call; the environment that `multihost.launch` sets
  (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`); a
  cluster (Slurm, Open MPI 4 and 5, Kubernetes, a TPU pod: docs/launcher.md);
  else (a lone TPU machine too) it is a single controller, no jax.distributed.
  Leaves stdout alone (gloo's lines are dropped by readers: docs/launcher.md).

  Args:
    coordinator_address: 'host:port' of process 0's coordination service.
    num_processes: number of controllers.
    process_id: this controller's index.
    local_device_ids: restricts this process to these local devices.
    cluster_detection_method: passed to `jax.distributed.initialize`.
    initialization_timeout: seconds to wait for every process to connect.
    heartbeat_timeout_seconds: seconds without a heartbeat before the
      coordination service declares a process dead. Default:
      $MULTIHOST_HEARTBEAT_TIMEOUT, else 10 s with failure detection on
      (JAX's default, 100 s, without).
    shutdown_timeout_seconds: seconds the shutdown barrier waits (with
      failure detection on: how long process 0 waits at exit for the
      others).
    coordinator_bind_address: where process 0's service listens. Default:
      the host of coordinator_address (never all interfaces).
    slice_index: passed to `jax.distributed.initialize` (deprecated there in
      favour of `partition_index`).
    partition_index: passed to `jax.distributed.initialize`.
    detect_failures: turn on JAX's `jax_enable_recoverability` and start a
      watchdog, so that when a peer dies every surviving process raises
      `ProcessFailureError` naming it (within heartbeat_timeout + 2 s)
      instead of being aborted by JAX. Default: on, unless
      $MULTIHOST_DETECT_FAILURES=0 or $JAX_ENABLE_RECOVERABILITY is set false.

  Raises:
    ValueError: for inconsistent arguments (the message repeats them).
    MultihostError: the job cannot be found (Open MPI 5, a Kubernetes Job, a
      TPU VM's metadata server silent for 5 s; the message says what to do).
  """
  if jax.distributed.is_initialized():
    logging.info('%s jax.distributed is already initialized; leaving it as '
                 'is.', failures.prefix())
    rt = runtime.current()
    rt.watchdog.ensure_started()
    rt.where.ensure_started()
    return
  # Before any child starts (companion, subprocesses): none inherits it.
  secret.take_from_environment()
  env = os.environ
  job = chain.describe(env, job_lib.Request.of(
      env, coordinator_address=coordinator_address,
      num_processes=num_processes, process_id=process_id,
      local_device_ids=local_device_ids,
      cluster_detection_method=cluster_detection_method,
      timeout=initialization_timeout))
  if not job.distributed:
    logging.info('Running as a single controller without jax.distributed '
                 '(%s).', job.why)
    return
  # Debug: a clean run's output stays the same under every engine.
  logging.debug('%s the job, found by %s: %s.',
                failures.prefix(job.process_id), job.engine, job.why)
  kwargs: dict[str, Any] = dict(
      **job.jax_arguments(),
      initialization_timeout=int(initialization_timeout),
      shutdown_timeout_seconds=int(shutdown_timeout_seconds),
  )
  kwargs.update({k: v for k, v in (('slice_index', slice_index), (
      'partition_index', partition_index)) if v is not None})
  heartbeat = (settings.heartbeat() if heartbeat_timeout_seconds is None
               else heartbeat_timeout_seconds)
  detect = _detect_failures(detect_failures)
  _set_heartbeat(kwargs, heartbeat, detect=detect)
  _set_bind_address(kwargs, coordinator_bind_address, env)
  companion = _start_distributed(kwargs, env, detect=detect, held=job.hold)
  _start_runtime(companion, kwargs, detect=detect,
                 shutdown_timeout=shutdown_timeout_seconds)


def _set_heartbeat(kwargs: dict[str, Any], heartbeat: float | None, *,
                   detect: bool) -> None:
  """The heartbeat timeout in `kwargs` (`heartbeat`, or with failure detection 10 s); failure detection turns on JAX's recoverability."""
  if detect:
    # Must be set before jax.distributed.initialize (the service reads it).
    jax.config.update('jax_enable_recoverability', True)
    if heartbeat is None:
      heartbeat = _env.DEFAULT_HEARTBEAT_S
  if heartbeat is not None:
    kwargs['heartbeat_timeout_seconds'] = max(1, int(heartbeat))


def _set_bind_address(
    kwargs: dict[str, Any], coordinator_bind_address: str | None,
    env: Mapping[str, str], *,
    resolve: Callable[..., list[Any]] = socket.getaddrinfo) -> None:
  """The coordinator's bind address in `kwargs`: the argument, else (process 0, no bind address in the environment, no external service) the coordinator address's own host.

  In a Kubernetes pod, process 0 waits for its own name to resolve (it does
  once the pod is Ready), within the initialization timeout, which the wait
  then shortens.
  """
  coordinator_address = kwargs['coordinator_address']
  if (coordinator_bind_address is None and
      not env.get(_env.COORDINATOR_BIND) and
      not settings.external_service() and
      kwargs['process_id'] == 0 and coordinator_address):
    timeout = kwargs['initialization_timeout']
    started = time.monotonic()
    coordinator_bind_address = _bind_address(
        coordinator_address,
        wait_s=timeout if kubernetes.in_pod(env) else 0.0, resolve=resolve)
    kwargs['initialization_timeout'] = max(1, int(
        timeout - (time.monotonic() - started)))
  if coordinator_bind_address is not None:
    kwargs['coordinator_bind_address'] = coordinator_bind_address


def _start_distributed(kwargs: dict[str, Any], env: Mapping[str, str], *,
                       detect: bool, held: socket.socket | None) -> Any:
  """Starts the coordination service's companion (process 0, where it hosts the service), waits for the service (the others), and `jax.distributed`; returns the companion or None. Closes `held` (a socket that held the service's port) once the service has it."""
  companion = None
  external = settings.external_service()
  if detect and not external and _companion.enabled():
    companion = _companion.start_for_job(kwargs, env)  # Process 0: starts it.
  address, index = kwargs['coordinator_address'], kwargs['process_id']
  if address and index not in (None, 0):
    waited = time.monotonic()
    _companion.await_service(address, kwargs['initialization_timeout'])
    kwargs['initialization_timeout'] = max(1, int(
        kwargs['initialization_timeout'] - (time.monotonic() - waited)))
  try:
    # JAX's advice at the service start, and its detection's warning in a
    # pod without the `kubernetes` package, are hidden.
    with (_companion.cpp_advice_hidden(),
          coordination.kubernetes_warning_hidden()):
      if companion is not None or external:
        # The companion (or a launcher) hosts the coordination service (see
        # `runtime.coordination.start_service`): process 0 must not start another.
        coordination.initialize_without_service(**kwargs)
      else:
        jax.distributed.initialize(**kwargs)
  except BaseException:
    if companion is not None:
      companion.finish()
    raise
  finally:
    if held is not None:
      held.close()
  return companion


def _start_runtime(companion: Any, kwargs: dict[str, Any], *, detect: bool,
                   shutdown_timeout: int) -> None:
  """The runtime on JAX's new client: it owns the companion (if any), and its watchdog (with failure detection) and where-responder start."""
  rt = runtime.current()  # The runtime on JAX's new client.
  if companion is not None:
    rt.companion = companion
    rt.exit_steps['companion'] = companion.finish
  if detect:
    rt.watchdog.start(
        heartbeat_timeout=kwargs['heartbeat_timeout_seconds'],
        shutdown_timeout=shutdown_timeout)
  rt.where.ensure_started()
  rt.log.info('jax.distributed initialized: %d processes, %d local devices.',
              rt.count, jax.local_device_count())


def is_initialized() -> bool:
  """Whether `jax.distributed` is initialized (by `initialize()` or by the program)."""
  return jax.distributed.is_initialized()


def _bind_address(coordinator_address: str, *, wait_s: float = 0.0,
                  resolve: Callable[..., list[Any]] = socket.getaddrinfo
                  ) -> str:
  """Where process 0's service listens: the coordinator address's own host, never all interfaces.

  `wait_s` > 0: waits up to that many seconds for the host name to resolve
  (`clusters.kubernetes.await_own_name`).

  Raises:
    ValueError: that host is not an address of this machine.
    MultihostError: the host name did not resolve within `wait_s` seconds.
  """
  host, _, port = coordinator_address.rpartition(':')
  host = host.strip('[]')
  try:
    if wait_s > 0:
      infos = kubernetes.await_own_name(host, int(port), timeout=wait_s,
                                        resolve=resolve)
    else:
      infos = resolve(host, int(port), type=socket.SOCK_STREAM)
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
      probe.bind((address[0], 0))
  except (OSError, ValueError, IndexError) as e:
    raise ValueError(
        f'process 0 cannot bind the coordination service to the host of '
        f'coordinator_address={coordinator_address!r} ({e}). Pass '
        'coordinator_bind_address= (e.g. "10.0.0.5:1234"; "[::]:1234" for '
        'all interfaces, which must then be firewalled).') from e
  ip = address[0]
  return f'[{ip}]:{port}' if ':' in ip else f'{ip}:{port}'


def _detect_failures(detect_failures: bool | None) -> bool:
  """Whether to turn on failure detection (see `initialize`)."""
  if detect_failures is not None:
    return bool(detect_failures)
  return settings.detect_failures()
