"""Clusters: JAX's own cluster detection, the last engine: a detection method asked for (`mpi4py`, `gcetpu`, ...), a Kubernetes Job through its API, and what else JAX knows.

JAX's detection is reached through `runtime.coordination.detect_cluster`
(the one module that touches JAX's internals). In an indexed Kubernetes Job
JAX needs the `kubernetes` package: without it, this engine says what to
install or set instead of letting JAX fail.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
import importlib.util

from multihost import env as _env
from multihost._src.clusters import job
from multihost._src.clusters import openmpi
from multihost._src.clusters import slurm
from multihost._src.runtime import coordination
from multihost._src.runtime import errors

ENGINE = 'jax'

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


def detect(environ: Mapping[str, str], request: job.Request, *,
           engine: str = ENGINE, why: str | None = None
           ) -> job.JobDescription:
  """The job as JAX's detection gives it (with `request.cluster_detection_method` if set), the request's values kept.

  Raises:
    MultihostError: an indexed Kubernetes Job without the `kubernetes`
      package (the message says what to do).
    ValueError: JAX's detection left the coordinator, count or index unknown.
  """
  method = request.cluster_detection_method
  if (method is None and job.in_indexed_job(environ) and
      not job.markers(environ) and
      importlib.util.find_spec('kubernetes') is None):
    raise errors.MultihostError(_NO_KUBERNETES_CLIENT.format(
        index=environ[_env.JOB_COMPLETION_INDEX]))
  local: Sequence[int] | None
  if method == 'deactivate':  # JAX's word for "no detection".
    address, count, index, local = (
        request.coordinator_address, request.num_processes,
        request.process_id, request.local_device_ids)
  else:
    address, count, index, local = coordination.detect_cluster(
        request.coordinator_address, request.num_processes,
        request.process_id, request.local_device_ids, method,
        timeout=request.timeout)
  if why is None:
    why = (f"JAX's {method!r} detection" if method else
           "JAX's own cluster detection")
  return job.found(request, coordinator_address=address,
                   num_processes=count, process_id=index,
                   local_device_ids=local, engine=engine, why=why)


def local_device_ids(environ: Mapping[str, str], request: job.Request
                     ) -> tuple[int, ...] | None:
  """This process's devices, for a job whose engine does not say: the request's, else as JAX's detection would restrict them (None: every local device).

  With a detection method asked, JAX's detection by it; without, the local
  rank of an Open MPI 4 job or of a Slurm step (JAX checks them in that
  order; its other clusters restrict nothing).
  """
  if request.local_device_ids is not None:
    return request.local_device_ids
  method = request.cluster_detection_method
  if method == 'deactivate':
    return None
  if method is not None:
    local = coordination.detect_cluster(
        request.coordinator_address, request.num_processes,
        request.process_id, None, method, timeout=request.timeout)[3]
  else:
    local = (openmpi.local_device_ids(environ) if _env.OMPI_HNP_URI in environ
             else slurm.local_device_ids(environ))
  return None if local is None else tuple(local)
