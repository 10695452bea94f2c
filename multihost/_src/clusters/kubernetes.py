"""Clusters: a pod of an indexed Kubernetes Job (or JobSet) given the coordinator and the process count, whose index is `$JOB_COMPLETION_INDEX` (JAX's rule there); and process 0's wait for its own name.

docs/launcher.md's manifest sets `JAX_COORDINATOR_ADDRESS` (the pod of
index 0 through the Job's headless service, `JOB-0.SUBDOMAIN:PORT`) and
`JAX_NUM_PROCESSES`; Kubernetes sets `JOB_COMPLETION_INDEX` in each pod.
Without them, JAX's own detection asks the Kubernetes API
(`clusters.jax_detection`, which needs the `kubernetes` package).

A pod's name in the headless service resolves only once the pod is Ready,
so process 0 may start before its own name resolves: `await_own_name`
waits for it, up to the initialization timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
import socket
import time
from typing import Any

from absl import logging

from multihost import env as _env
from multihost._src.clusters import jax_detection
from multihost._src.clusters import job
from multihost._src.runtime import errors

ENGINE = 'kubernetes'
# How often process 0 asks again whether its own name resolves.
RESOLVE_EVERY_S = 0.5
# How often it says, in the log, that it still waits.
SAY_EVERY_S = 30.0


def detect(environ: Mapping[str, str],
           request: job.Request) -> job.JobDescription | None:
  """In an indexed Job given the coordinator and count (not the index): the job, its index `$JOB_COMPLETION_INDEX`; else None.

  Raises:
    ValueError: the index is not in [0, count).
  """
  if not (job.in_indexed_job(environ) and request.coordinator_address and
          request.num_processes and request.process_id is None):
    return None
  index = int(environ[_env.JOB_COMPLETION_INDEX])
  return job.found(
      request, process_id=index,
      local_device_ids=jax_detection.local_device_ids(environ, request),
      engine=ENGINE,
      why=(f'an indexed Job\'s pod, given: {", ".join(request.given)}; '
           f'the index ${_env.JOB_COMPLETION_INDEX}={index}'))


def in_pod(environ: Mapping[str, str]) -> bool:
  """Whether this process runs in a Kubernetes pod."""
  return _env.K8S_SERVICE_HOST in environ


def await_own_name(
    host: str, port: int, *, timeout: float,
    resolve: Callable[..., list[Any]] = socket.getaddrinfo,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic) -> list[Any]:
  """Process 0's own coordinator host, resolved (`socket.getaddrinfo`'s answer), waiting up to `timeout` seconds for it to resolve.

  In a pod, process 0's name in the Job's headless service resolves only
  once the pod is Ready, which may be after the program starts. The log
  says what it waits for (at once, then every `SAY_EVERY_S`).

  Raises:
    MultihostError: the name did not resolve within `timeout` seconds (the
      message names it, the timeout and the last lookup error).
  """
  start = clock()
  said = None
  while True:
    try:
      return resolve(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
      waited = clock() - start
      if waited >= timeout:
        raise errors.MultihostError(
            f'process 0: its own coordinator host {host!r} (from '
            f'coordinator_address, port {port}) did not resolve within the '
            f'initialization timeout of {timeout:g} s (last lookup: {e}). In '
            'a Kubernetes Job, the name JOB-0.SUBDOMAIN resolves once the pod '
            'of index 0 is Ready and the Job\'s headless service (the pod\'s '
            'subdomain) exists: check both, or raise '
            'initialize(initialization_timeout=...).') from e
      if said is None or waited - said >= SAY_EVERY_S:
        said = waited
        logging.warning(
            'process 0: waiting for its own coordinator host %r to resolve '
            '(%s; a pod\'s name in its Job\'s headless service resolves once '
            'the pod is Ready), %.0f s of %g s so far.', host, e, waited,
            timeout)
      sleep(min(RESOLVE_EVERY_S, max(0.0, timeout - waited)))
