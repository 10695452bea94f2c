"""Clusters: no cluster at all, a single controller (no `jax.distributed`).

The chain reaches it when no engine before it found the job: without a
detection method asked and with no cluster's variables in the environment,
the program runs as one controller.
"""

from __future__ import annotations

from collections.abc import Mapping

from multihost._src.clusters import job

ENGINE = 'single'


def detect(environ: Mapping[str, str],
           request: job.Request) -> job.JobDescription | None:
  """A single controller where nothing says otherwise; None where a cluster's variables (or a detection method) leave it to JAX's detection.

  Raises:
    ValueError: part of the job's arguments were given, not all.
  """
  if (request.cluster_detection_method is not None or job.markers(environ)
      or job.in_indexed_job(environ)):
    return None
  return job.single(
      request, engine=ENGINE,
      why='no launcher variables, Slurm step, Open MPI job, TPU pod or '
      'indexed Kubernetes Job found')
