"""Clusters: the one chain that finds the job: each engine in turn reads the environment, and the first that finds the job describes it.

`describe()` is what `initialize()` calls, once. The order is the order of
precedence: the job as given (arguments, a launcher's variables); an indexed
Kubernetes Job given its coordinator and count; Open MPI 5 (PRRTE), then
Open MPI 4 and Slurm (as JAX's detection reads them); a Cloud TPU host; a
single controller where nothing says otherwise; and last JAX's own
detection (a method asked for, a Kubernetes Job through its API).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping

from multihost._src.clusters import alone
from multihost._src.clusters import explicit
from multihost._src.clusters import jax_detection
from multihost._src.clusters import job
from multihost._src.clusters import kubernetes
from multihost._src.clusters import openmpi
from multihost._src.clusters import prrte
from multihost._src.clusters import slurm
from multihost._src.clusters import tpu

Engine = Callable[[Mapping[str, str], job.Request], 'job.JobDescription | None']

# In order of precedence; the last always answers (or raises).
ENGINES: tuple[Engine, ...] = (
    explicit.detect, kubernetes.detect, prrte.detect, openmpi.detect,
    slurm.detect, tpu.detect, alone.detect, jax_detection.detect)


def describe(environ: Mapping[str, str], request: job.Request, *,
             engines: tuple[Engine, ...] = ENGINES) -> job.JobDescription:
  """The job, as the first engine that finds it describes it.

  Raises:
    ValueError: inconsistent or partial arguments (the message repeats
      them), or a cluster whose variables leave the coordinator, count or
      index unknown.
    MultihostError: the job cannot be found (Open MPI 5 without its address,
      a Kubernetes Job without the `kubernetes` package, a TPU VM's metadata
      server silent for 5 s; the message says what to do).
  """
  for detect in engines:
    found = detect(environ, request)
    if found is not None:
      return found
  raise AssertionError(f'no engine of {engines} described the job')
