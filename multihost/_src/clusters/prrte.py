"""Open MPI 5 jobs (`mpirun`/`mpiexec` of PRRTE): the coordinator, process count and index, which JAX's own detection does not find there.

JAX detects Open MPI by `OMPI_MCA_orte_hnp_uri`, which Open MPI 4's `mpirun`
sets and Open MPI 5's does not (it sets `OMPI_COMM_WORLD_*`, `PMIX_*` and
`PRTE_LAUNCHED`): there `jax.distributed.initialize()` stops with
"coordinator_address should be defined". Here the count and index come from
`OMPI_COMM_WORLD_SIZE`/`_RANK`; process 0's address is its own to choose and
reaches the others through PMIx (`clusters.pmix`), whose server every process
of the job is connected to: on one host it is 127.0.0.1, across hosts
process 0's host name; the port is `$JAX_COORDINATOR_PORT`, else a free one
that process 0 holds until its service binds it.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import socket
import zlib

from multihost import env
from multihost._src.clusters import job
from multihost._src.clusters import pmix
from multihost._src.runtime import errors

# What process 0 shares instead of an address when it cannot give one: the
# others then raise its message at once, not after the timeout.
_FAILED = '!'

# JAX's range for the ports it derives from a job id (Open MPI 4, mpi4py).
_PORT_BASE = 65536 - 4096


@dataclasses.dataclass(frozen=True)
class Found:
  """Where this process of an Open MPI 5 job finds the coordinator.

  `hold` (process 0, when it chose the port) keeps the port from anyone
  else until the service binds it; close it once `jax.distributed` is up.
  """
  address: str
  count: int
  index: int
  local_index: int
  hold: socket.socket | None = None
  how: str = 'given'  # How the address was found, in words.


ENGINE = 'open-mpi-5'


def launched(e: Mapping[str, str]) -> bool:
  """Whether Open MPI 5's launcher (PRRTE) started this process (and Open MPI 4's did not), by its variables `e`."""
  return (env.OMPI_SIZE in e and env.OMPI_RANK in e and
          env.OMPI_HNP_URI not in e and
          (env.PRTE_LAUNCHED in e or env.PMIX_NAMESPACE in e))


def _int(environ: Mapping[str, str], name: str) -> int:
  value = environ.get(name, '')
  try:
    return int(value)
  except ValueError:
    raise errors.MultihostError(
        f'Open MPI 5 job: ${name} is {value!r}, not a number; run the '
        'program under mpirun, or set JAX_COORDINATOR_ADDRESS, '
        'JAX_NUM_PROCESSES and JAX_PROCESS_ID.') from None


def derived_port(namespace: str) -> int:
  """A port from the job's PMIx namespace, the same in every process (JAX's range)."""
  return _PORT_BASE + zlib.crc32(namespace.encode()) % 4096


def _hold_free_port(host: str) -> socket.socket:
  """A socket on a free port of `host` that the coordination service can still bind.

  Bound with SO_REUSEPORT (as JAX's service binds) and never listening, so
  no other program's port-0 bind gets the port and the service's does (the
  reason `multihost.launch.hold_free_port` holds its port too).
  """
  family, _, _, _, where = socket.getaddrinfo(
      host, 0, type=socket.SOCK_STREAM)[0]
  s = socket.socket(family, socket.SOCK_STREAM)
  try:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(where[:2])
  except BaseException:
    s.close()
    raise
  return s


def first_address(*, single_host: bool, hostname: str,
                  port: str | None) -> tuple[str, socket.socket | None]:
  """Process 0's choice: ('host:port', the socket that holds the port or None).

  On one host the service listens on 127.0.0.1; across hosts on the address
  of `hostname`, which must not be a loopback one. `port`: the user's
  (`$JAX_COORDINATOR_PORT`), else a free one, held.

  Raises:
    MultihostError: across hosts, `hostname` does not resolve to an address
      other hosts can reach.
  """
  host = '127.0.0.1'
  if not single_host:
    host = hostname
    try:
      ip = str(socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][4][0])
    except OSError as e:
      raise errors.MultihostError(
          f'process 0 of an Open MPI 5 job across hosts cannot resolve its '
          f'own host name {host!r} ({e}). Set JAX_COORDINATOR_ADDRESS='
          '"ADDRESS:PORT" (process 0\'s address) for every rank (mpirun -x '
          'JAX_COORDINATOR_ADDRESS=...).') from e
    if ip.startswith('127.') or ip == '::1':
      raise errors.MultihostError(
          f'process 0 of an Open MPI 5 job across hosts: its host name '
          f'{host!r} resolves to {ip}, a loopback address the other hosts '
          'cannot reach (see /etc/hosts). Set JAX_COORDINATOR_ADDRESS='
          '"ADDRESS:PORT" (process 0\'s address) for every rank (mpirun -x '
          'JAX_COORDINATOR_ADDRESS=...).')
  if port:
    return f'{host}:{int(port)}', None
  hold = _hold_free_port(host)
  return f'{host}:{hold.getsockname()[1]}', hold


def detect(environ: Mapping[str, str],
           request: job.Request) -> job.JobDescription | None:
  """The job under Open MPI 5's mpirun, the request's values kept; None outside one (or where a detection method is asked).

  Every process of the job calls it (process 0 gives its address to the
  others through PMIx).

  Raises:
    MultihostError: the address cannot be found (`find`).
  """
  if request.cluster_detection_method is not None or not launched(environ):
    return None
  where = find(request.coordinator_address, environ=environ,
               timeout=request.timeout)
  return job.found(
      request, coordinator_address=where.address,
      num_processes=where.count, process_id=where.index,
      local_device_ids=[where.local_index],  # As JAX's for Open MPI 4.
      engine=ENGINE, hold=where.hold,
      why=(f'Open MPI 5\'s mpirun (PRRTE): ${env.OMPI_SIZE}, '
           f'${env.OMPI_RANK}, ${env.OMPI_LOCAL_RANK}; the coordinator '
           f'{where.how}'))


def find(coordinator_address: str | None, *, environ: Mapping[str, str],
         timeout: float) -> Found:
  """Where this process of an Open MPI 5 job finds the coordinator; every process calls it.

  `coordinator_address` (the user's) is kept; else process 0 chooses one
  (`first_address`) and gives it to the others through PMIx, waiting up to
  `timeout` seconds. Without a libpmix, a job on one host uses 127.0.0.1
  and a port derived from the job's namespace (`derived_port`).

  Raises:
    MultihostError: the address cannot be found; the message says what to
      install or set.
  """
  count, index = _int(environ, env.OMPI_SIZE), _int(environ, env.OMPI_RANK)
  local_index = _int(environ, env.OMPI_LOCAL_RANK)
  single_host = _int(environ, env.OMPI_LOCAL_SIZE) == count
  port = environ.get(env.COORDINATOR_PORT)
  if coordinator_address:
    return Found(coordinator_address, count, index, local_index)
  if not pmix.available():
    if single_host:
      namespace = environ.get(env.PMIX_NAMESPACE, '')
      chosen = port or derived_port(namespace)
      return Found(f'127.0.0.1:{int(chosen)}', count, index, local_index,
                   how='on one host, without PMIx: 127.0.0.1 and '
                   + ('$' + env.COORDINATOR_PORT if port else
                      "a port derived from the job's namespace"))
    raise errors.MultihostError(
        f'process {index} of an Open MPI 5 job across hosts cannot find '
        'process 0\'s address: no PMIx client library (libpmix, part of '
        f'Open MPI 5) loads (tried: {pmix.library_paths() or "none"}). Set '
        'JAX_COORDINATOR_ADDRESS="HOST:PORT" (process 0\'s host) for every '
        'rank (mpirun -x JAX_COORDINATOR_ADDRESS=...), or install mpi4py and '
        "pass cluster_detection_method='mpi4py'.")
  hold, mine, failure = None, None, None
  if index == 0:
    try:
      mine, hold = first_address(single_host=single_host,
                                 hostname=socket.gethostname(), port=port)
    except (errors.MultihostError, OSError) as e:
      failure = e
      mine = _FAILED + str(e)
  try:
    shared = pmix.share_from_first(mine, timeout=timeout)
  except pmix.PmixError as e:
    if hold is not None:
      hold.close()
    raise errors.MultihostError(
        f'process {index} of an Open MPI 5 job could not get process 0\'s '
        f'address through PMIx: {e}. Set JAX_COORDINATOR_ADDRESS="HOST:PORT" '
        '(process 0\'s host) for every rank (mpirun -x '
        'JAX_COORDINATOR_ADDRESS=...).') from e
  if failure is not None:
    raise failure
  if shared.startswith(_FAILED):
    raise errors.MultihostError(
        f'process {index}: process 0 could not choose the coordinator '
        f'address: {shared[len(_FAILED):]}')
  return Found(shared, count, index, local_index, hold,
               how="process 0's, shared through PMIx")
