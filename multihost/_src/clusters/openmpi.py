"""Clusters: an Open MPI 4 job (`mpirun` of ORTE), read from its variables as JAX's `ompi` detection reads them.

The coordinator is on the launcher's host (the first address of
`OMPI_MCA_orte_hnp_uri`), on `$JAX_COORDINATOR_PORT` or a port derived from
the job id (JAX's range); count, index and local index are
`OMPI_COMM_WORLD_SIZE`, `_RANK` and `_LOCAL_RANK`. Open MPI 5 sets no
`OMPI_MCA_orte_hnp_uri`: `clusters.prrte` finds those jobs.
tests/unit/test_clusters.py holds these to JAX's own answers.
"""

from __future__ import annotations

from collections.abc import Mapping
import re

from multihost import env as _env
from multihost._src.clusters import job
from multihost._src.runtime import coordination

ENGINE = 'open-mpi-4'
# 'JOBID.0;tcp://10.0.0.1,10.0.0.2:34911' or 'JOBID.0;tcp6://[fe80::1,...]:43370'.
_LAUNCHER = re.compile(r'tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]')


def detect(environ: Mapping[str, str],
           request: job.Request) -> job.JobDescription | None:
  """The job of an Open MPI 4 `mpirun`, the request's values kept; None outside one.

  Raises:
    ValueError: the launcher's URI holds no address.
  """
  uri = environ.get(_env.OMPI_HNP_URI)
  if uri is None or request.cluster_detection_method is not None:
    return None  # A method asked: JAX's detection by it.
  address = request.coordinator_address
  if address is None:
    port = environ.get(_env.COORDINATOR_PORT)
    if not port:
      job_id = int(uri.split('.', maxsplit=1)[0]) // 2**12
      port = str(job_id % 2**12 + (65535 - 2**12 + 1))
    match = _LAUNCHER.search(uri)
    if match is None:
      raise ValueError(
          f'Open MPI 4 job: ${_env.OMPI_HNP_URI}={uri!r} holds no launcher '
          f'address; set ${_env.COORDINATOR} (process 0\'s HOST:PORT).')
    host = next(g for g in match.groups() if g is not None)
    address = f'{host}:{port}'
  return job.found(
      request, coordinator_address=address,
      num_processes=_int(environ, _env.OMPI_SIZE),
      process_id=_int(environ, _env.OMPI_RANK),
      local_device_ids=local_device_ids(environ), engine=ENGINE,
      why=(f'Open MPI 4\'s mpirun: ${_env.OMPI_HNP_URI}, ${_env.OMPI_SIZE}, '
           f'${_env.OMPI_RANK}, ${_env.OMPI_LOCAL_RANK}'))


def local_device_ids(environ: Mapping[str, str]) -> list[int] | None:
  """This rank's device in an Open MPI 4 job (JAX's rule: its local rank, none on a Cloud TPU VM); None outside one."""
  if _env.OMPI_HNP_URI not in environ:
    return None
  if coordination.running_on_cloud_tpu_vm():
    return None
  local = _int(environ, _env.OMPI_LOCAL_RANK)
  return None if local is None else [local]


def _int(environ: Mapping[str, str], name: str) -> int | None:
  value = environ.get(name)
  return None if value is None else int(value)
