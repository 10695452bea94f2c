"""Clusters: what `initialize()` was asked (`Request`) and the job every engine describes (`JobDescription`).

Every engine (`clusters.chain` lists them in order) is one module with one
function, `detect(environ, request) -> JobDescription | None`: None when its
environment is absent, else the whole job, the request's values kept where
given. `request` holds `initialize()`'s arguments and the launcher's
variables (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`,
`JAX_LOCAL_DEVICE_IDS`), which count as given.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
import dataclasses
import socket
from typing import Any

from multihost import env as _env


def check_index(num_processes: int | None, process_id: int | None) -> None:
  """Raises ValueError when both are known and `process_id` is not in [0, num_processes)."""
  if num_processes is not None and process_id is not None and not (
      0 <= process_id < num_processes):
    raise ValueError(
        f'process_id must be in [0, num_processes); got process_id='
        f'{process_id}, num_processes={num_processes}.')


@dataclasses.dataclass(frozen=True)
class Request:
  """What `initialize()` was given, by its arguments or the launcher's variables; None where neither says.

  `given` names where each given value came from (an argument or a
  variable), for a description's `why`.
  """
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  local_device_ids: tuple[int, ...] | None = None
  cluster_detection_method: str | None = None
  timeout: float = 300.0
  given: tuple[str, ...] = ()

  @classmethod
  def of(cls, environ: Mapping[str, str], *,
         coordinator_address: str | None = None,
         num_processes: int | None = None, process_id: int | None = None,
         local_device_ids: int | Sequence[int] | None = None,
         cluster_detection_method: str | None = None,
         timeout: float = 300.0) -> Request:
    """The request of `initialize(...)`: each argument, else its launcher variable in `environ`.

    Raises:
      ValueError: process_id is not in [0, num_processes).
    """
    given = []

    def pick(value, name, variable, parse):
      if value is not None and value != '':
        given.append(name)
        return value
      if environ.get(variable):
        given.append(f'${variable}')
        return parse(environ[variable])
      return None

    address = pick(coordinator_address, 'coordinator_address',
                   _env.COORDINATOR, str)
    count = pick(num_processes, 'num_processes', _env.NUM_PROCESSES, int)
    index = pick(process_id, 'process_id', _env.PROCESS_ID, int)
    if isinstance(local_device_ids, int):
      local_device_ids = [local_device_ids]
    local = pick(None if local_device_ids is None else tuple(local_device_ids),
                 'local_device_ids', _env.LOCAL_DEVICE_IDS,
                 lambda s: tuple(int(x) for x in s.split(',')))
    check_index(count, index)
    return cls(address, count, index, local, cluster_detection_method,
               float(timeout), tuple(given))

  @property
  def complete(self) -> bool:
    """Whether the coordinator, the process count and the index are all given."""
    return None not in (self.coordinator_address, self.num_processes,
                        self.process_id)

  @property
  def partial(self) -> bool:
    """Whether some of the three are given, not all."""
    return not self.complete and any(
        v is not None for v in (self.coordinator_address, self.num_processes,
                                self.process_id))


@dataclasses.dataclass(frozen=True)
class JobDescription:
  """The job as one engine found it: where the coordinator is, how many processes, which one this is, its devices, and why.

  `coordinator_address` is None for a single controller (no
  `jax.distributed`; then `num_processes` is 1 and `process_id` 0).
  `local_device_ids` None: every local device (JAX's default). `engine`
  names the module that found it, `why` says what in the environment it
  read. `hold` (Open MPI 5's process 0, when it chose the port) keeps the
  port from anyone else until the coordination service binds it: close it
  once `jax.distributed` is up.
  """
  coordinator_address: str | None
  num_processes: int
  process_id: int
  local_device_ids: tuple[int, ...] | None
  engine: str
  why: str
  hold: socket.socket | None = dataclasses.field(
      default=None, compare=False, repr=False)

  @property
  def distributed(self) -> bool:
    """Whether the job runs `jax.distributed` (more than a single controller)."""
    return self.coordinator_address is not None

  def jax_arguments(self) -> dict[str, Any]:
    """The job's arguments of `jax.distributed.initialize`, with JAX's own detection off (this description is its result)."""
    return dict(
        coordinator_address=self.coordinator_address,
        num_processes=self.num_processes,
        process_id=self.process_id,
        local_device_ids=(None if self.local_device_ids is None else
                          list(self.local_device_ids)),
        cluster_detection_method='deactivate')


def found(request: Request, *, coordinator_address: str | None = None,
          num_processes: int | None = None, process_id: int | None = None,
          local_device_ids: Sequence[int] | None = None, engine: str,
          why: str, hold: socket.socket | None = None) -> JobDescription:
  """An engine's description: the request's values where given, else the engine's.

  Raises:
    ValueError: the coordinator, count or index is still unknown (the
      message names the engine and what it read), or the index is out of
      range.
  """
  address = request.coordinator_address or coordinator_address
  count = (request.num_processes if request.num_processes is not None
           else num_processes)
  index = (request.process_id if request.process_id is not None
           else process_id)
  local = (request.local_device_ids if request.local_device_ids is not None
           else None if local_device_ids is None else tuple(local_device_ids))
  missing = [name for name, v in (('coordinator_address', address),
                                  ('num_processes', count),
                                  ('process_id', index)) if v is None]
  if missing:
    if hold is not None:
      hold.close()
    raise ValueError(
        f'{" and ".join(missing)} should be defined: {engine} ({why}) did '
        f'not give {"them" if len(missing) > 1 else "it"}. Pass '
        'coordinator_address, num_processes and process_id to initialize() '
        f'(or set ${_env.COORDINATOR}, ${_env.NUM_PROCESSES} and '
        f'${_env.PROCESS_ID}).')
  assert address is not None and count is not None and index is not None
  check_index(count, index)
  return JobDescription(address, count, index, local, engine, why, hold)


def single(request: Request, *, engine: str, why: str) -> JobDescription:
  """A single controller (no `jax.distributed`).

  Raises:
    ValueError: some of the coordinator, count and index were given, not
      all (a job half described).
  """
  if request.partial:
    raise ValueError(
        'initialize() needs coordinator_address, num_processes and '
        f'process_id together; got coordinator_address='
        f'{request.coordinator_address!r}, num_processes='
        f'{request.num_processes!r}, process_id={request.process_id!r}. Pass '
        'all three, or run under `python -m multihost.launch` or a cluster '
        'JAX detects.')
  return JobDescription(None, 1, 0, None, engine, why)


def markers(environ: Mapping[str, str]) -> list[str]:
  """The variables present that mark a cluster JAX detects by its environment (Slurm, Open MPI, PMI)."""
  return [m for m in _env.CLUSTER_MARKERS if m in environ]


def in_indexed_job(environ: Mapping[str, str]) -> bool:
  """Whether this is a pod of an indexed Kubernetes Job (or JobSet); any other pod is no cluster."""
  return (_env.K8S_SERVICE_HOST in environ and
          _env.JOB_COMPLETION_INDEX in environ)
