"""Clusters: the job as given, by `initialize()`'s arguments or the variables a launcher sets (`multihost.launch`, a manifest).

The first engine of the chain: where the coordinator, the process count and
the index are all given, nothing else is read.
"""

from __future__ import annotations

from collections.abc import Mapping

from multihost._src.clusters import jax_detection
from multihost._src.clusters import job

ENGINE = 'explicit'


def detect(environ: Mapping[str, str],
           request: job.Request) -> job.JobDescription | None:
  """The job as given, when the coordinator, count and index all are; else None."""
  if not request.complete:
    return None
  return job.found(request,
                   local_device_ids=jax_detection.local_device_ids(
                       environ, request),
                   engine=ENGINE, why='given: ' + ', '.join(request.given))
