"""Runtime: `initialize()`, which brings up `jax.distributed`, builds the runtime on its client and starts the failure watchdog."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
import importlib.util
import os
import socket
import time
from typing import Any

from absl import logging
import jax

from multihost import env as _env
from multihost._src.auth import secret
from multihost._src.clusters import prrte
from multihost._src.clusters import tpu as tpu_cluster
from multihost._src.runtime import companion as _companion
from multihost._src.runtime import coordination
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import runtime
from multihost._src.runtime import settings

# An indexed Kubernetes Job without the client JAX's detection needs there.
_NO_KUBERNETES_CLIENT = (
    'process {index}: this pod is in an indexed Kubernetes Job, where JAX '
    'finds the coordinator, process count and index through the Kubernetes '
    'API with the `kubernetes` package, which is not installed. Install it '
    "(pip install 'jax[k8s]') and let the pod's service account read pods "
    'and jobs; or set JAX_COORDINATOR_ADDRESS (JOB-0.SUBDOMAIN:PORT, the '
    "pod of index 0 through the Job's headless service) and "
    "JAX_NUM_PROCESSES (the Job's parallelism) in the pod's environment: "
    'the index is then $JOB_COMPLETION_INDEX.')


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
  coordinator_address, num_processes, process_id = _job(
      env, coordinator_address, num_processes, process_id)
  held = None  # Open MPI 5: the port process 0 holds for its service.
  if (None in (coordinator_address, num_processes, process_id) and
      cluster_detection_method is None and prrte.launched()):
    (coordinator_address, num_processes, process_id, local_device_ids,
     held) = _open_mpi_5(env, coordinator_address, num_processes, process_id,
                         local_device_ids, timeout=initialization_timeout)
  explicit = None not in (coordinator_address, num_processes, process_id)
  if not explicit and cluster_detection_method is None:
    (coordinator_address, num_processes, process_id,
     cluster_detection_method) = _tpu_job(env, coordinator_address,
                                          num_processes, process_id)
    explicit = None not in (coordinator_address, num_processes, process_id)
    _check_kubernetes(env, explicit or cluster_detection_method is not None)
    if not (explicit or cluster_detection_method or _env.in_cluster()):
      _single_controller(coordinator_address, num_processes, process_id)
      return
  kwargs: dict[str, Any] = dict(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
      local_device_ids=local_device_ids,
      cluster_detection_method=cluster_detection_method,
      initialization_timeout=int(initialization_timeout),
      shutdown_timeout_seconds=int(shutdown_timeout_seconds),
  )
  kwargs.update({k: v for k, v in (('slice_index', slice_index), (
      'partition_index', partition_index)) if v is not None})
  heartbeat = (settings.heartbeat() if heartbeat_timeout_seconds is None
               else heartbeat_timeout_seconds)
  detect = _detect_failures(detect_failures)
  _set_heartbeat(kwargs, heartbeat, detect=detect)
  _set_bind_address(kwargs, coordinator_bind_address, env, explicit=explicit)
  companion = _start_distributed(kwargs, env, detect=detect, held=held)
  _start_runtime(companion, kwargs, detect=detect,
                 shutdown_timeout=shutdown_timeout_seconds)


def _job(env: Mapping[str, str], coordinator_address: str | None,
         num_processes: int | None, process_id: int | None
         ) -> tuple[str | None, int | None, int | None]:
  """(coordinator_address, num_processes, process_id): the arguments, else the environment `multihost.launch` sets.

  Raises:
    ValueError: process_id is not in [0, num_processes).
  """
  coordinator_address = coordinator_address or env.get(_env.COORDINATOR)
  if num_processes is None and env.get(_env.NUM_PROCESSES):
    num_processes = int(env[_env.NUM_PROCESSES])
  if process_id is None and env.get(_env.PROCESS_ID):
    process_id = int(env[_env.PROCESS_ID])
  if (process_id is None and coordinator_address and num_processes and
      _env.in_kubernetes_job()):
    process_id = int(env[_env.JOB_COMPLETION_INDEX])  # JAX's rule there.
  if num_processes is not None and process_id is not None and not (
      0 <= process_id < num_processes):
    raise ValueError(
        f'process_id must be in [0, num_processes); got process_id='
        f'{process_id}, num_processes={num_processes}.')
  return coordinator_address, num_processes, process_id


def _tpu_job(env: Mapping[str, str], coordinator_address: str | None,
             num_processes: int | None, process_id: int | None
             ) -> tuple[Any, ...]:
  """(coordinator_address, num_processes, process_id, cluster_detection_method) as a Cloud TPU environment gives them (`clusters.tpu`), those given kept, where another cluster's variables are absent; on a lone TPU machine the three as given and no method (a single controller)."""
  tpu = None
  if not any(m in env for m in _env.CLUSTER_MARKERS):
    tpu = tpu_cluster.find(env)
  if isinstance(tpu, tuple):  # A TPU pod's host: JAX's values, no lookup.
    return (coordinator_address or tpu[0],
            tpu[1] if num_processes is None else num_processes,
            tpu[2] if process_id is None else process_id, None)
  return (coordinator_address, num_processes, process_id,
          'gcetpu' if tpu == tpu_cluster.DETECT else None)


def _open_mpi_5(env: Mapping[str, str], coordinator_address: str | None,
                num_processes: int | None, process_id: int | None,
                local_device_ids: int | Sequence[int] | None, *,
                timeout: float) -> tuple[Any, ...]:
  """The job's arguments under Open MPI 5's mpirun (`clusters.prrte`), those given kept: (coordinator_address, num_processes, process_id, local_device_ids, the socket that holds process 0's port or None)."""
  found = prrte.find(coordinator_address, timeout=timeout)
  if local_device_ids is None and not env.get(_env.LOCAL_DEVICE_IDS):
    local_device_ids = [found.local_index]  # As JAX's for Open MPI 4.
  return (found.address,
          found.count if num_processes is None else num_processes,
          found.index if process_id is None else process_id,
          local_device_ids, found.hold)


def _check_kubernetes(env: Mapping[str, str], given: bool) -> None:
  """Raises MultihostError, saying what to do, in an indexed Kubernetes Job where JAX's detection would lack its `kubernetes` package (not `given` the job, nor a detection method)."""
  if (not given and _env.in_kubernetes_job() and
      not any(m in env for m in _env.CLUSTER_MARKERS) and
      importlib.util.find_spec('kubernetes') is None):
    raise errors.MultihostError(_NO_KUBERNETES_CLIENT.format(
        index=env[_env.JOB_COMPLETION_INDEX]))


def _single_controller(coordinator_address: str | None,
                       num_processes: int | None,
                       process_id: int | None) -> None:
  """No cluster and not all three of the job's arguments: says so, or raises for a partial set.

  Raises:
    ValueError: some of the three were given, not all.
  """
  if any(v is not None for v in (coordinator_address, num_processes,
                                 process_id)):
    raise ValueError(
        'initialize() needs coordinator_address, num_processes and '
        f'process_id together; got coordinator_address='
        f'{coordinator_address!r}, num_processes={num_processes!r}, '
        f'process_id={process_id!r}. Pass all three, or run under '
        '`python -m multihost.launch` or a cluster JAX detects.')
  logging.info('No cluster or coordinator found: running as a single '
               'controller without jax.distributed.')


def _set_heartbeat(kwargs: dict[str, Any], heartbeat: int | None, *,
                   detect: bool) -> None:
  """The heartbeat timeout in `kwargs` (`heartbeat`, or with failure detection 10 s); failure detection turns on JAX's recoverability."""
  if detect:
    # Must be set before jax.distributed.initialize (the service reads it).
    jax.config.update('jax_enable_recoverability', True)
    if heartbeat is None:
      heartbeat = _env.DEFAULT_HEARTBEAT_S
  if heartbeat is not None:
    kwargs['heartbeat_timeout_seconds'] = max(1, int(heartbeat))


def _set_bind_address(kwargs: dict[str, Any],
                      coordinator_bind_address: str | None,
                      env: Mapping[str, str], *, explicit: bool) -> None:
  """The coordinator's bind address in `kwargs`: the argument, else (process 0, no bind address in the environment, no external service) the coordinator address's own host, the job's arguments detected from the cluster first where they were not all given."""
  coordinator_address = kwargs['coordinator_address']
  process_id = kwargs['process_id']
  if (coordinator_bind_address is None and
      not env.get(_env.COORDINATOR_BIND) and
      not settings.external_service()):
    if not explicit:
      # What jax.distributed.initialize would derive from the cluster
      # (Slurm, Open MPI, Kubernetes, ...): without a bind address of our
      # own, JAX's process 0 listens on every interface.
      address, count, index = coordination.detect_cluster(
          coordinator_address, kwargs['num_processes'], process_id,
          kwargs['cluster_detection_method'])
      if None not in (address, count, index):
        coordinator_address, process_id = address, index
        kwargs.update(coordinator_address=address, num_processes=count,
                      process_id=index)
    if process_id == 0 and coordinator_address:
      coordinator_bind_address = _bind_address(coordinator_address)
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


def _bind_address(coordinator_address: str) -> str:
  """Where process 0's service listens: the coordinator address's own host, never all interfaces.

  Raises:
    ValueError: that host is not an address of this machine.
  """
  host, _, port = coordinator_address.rpartition(':')
  host = host.strip('[]')
  try:
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
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
