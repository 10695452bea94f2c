"""Clusters: Cloud TPU, whether this machine is a lone TPU host or one host of a TPU pod, found as JAX's TPU cluster detection would, without unbounded network lookups.

JAX's detection (`jax._src.clusters.cloud_tpu_cluster`) takes a machine
with `TPU_WORKER_HOSTNAMES` (GKE) for a pod host and then asks the GCE
metadata server for values the environment lacks; on a Cloud TPU VM
without that variable it asks the metadata server whether the VM is a pod
host at all. Each request may wait 60 s and is retried. A lone TPU machine
outside Google Cloud (one host, `TPU_WORKER_HOSTNAMES=localhost`) has no
such server, so `jax.distributed.initialize()` fails there. Here:

* a host list in the environment decides alone: one host and one slice is
  a single controller; more are a pod, whose coordinator, process count and
  index are JAX's formulas over the environment (no metadata);
* otherwise, on a TPU VM where JAX would ask (libtpu installed,
  `TPU_SKIP_MDS_QUERY` unset: JAX sets it where no TPU chip is), the
  metadata server is asked once, within `timeout` seconds in all; no answer
  raises `MultihostError` saying what to set; a pod host then joins through
  JAX's own `gcetpu` detection (`clusters.jax_detection`).
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import enum
import importlib.util
import threading
import urllib.error
import urllib.request

from multihost import env as _env
from multihost._src.clusters import jax_detection
from multihost._src.clusters import job
from multihost._src.runtime import errors

ENGINE = 'tpu'
# JAX's coordinator port on a TPU pod (cloud_tpu_cluster.coordinator_port).
JAX_TPU_PORT = '8482'
METADATA_TIMEOUT_S = 5.0


class Metadata(enum.Enum):
  """What a TPU VM's metadata server says of the machine."""
  NOT_A_POD_HOST = 'not a TPU pod host'
  LONE_HOST = 'a lone TPU host (one worker, one slice)'
  POD_HOST = 'a TPU pod host'


def detect(environ: Mapping[str, str], request: job.Request, *,
           timeout: float = METADATA_TIMEOUT_S) -> job.JobDescription | None:
  """The job of a Cloud TPU host, the request's values kept; None where no TPU environment says (or another cluster's variables are present, or a detection method is asked).

  A lone TPU host is a single controller, except in an indexed Kubernetes
  Job (None: JAX's detection decides there).

  Raises:
    ValueError: the host list is set and TPU_WORKER_ID is not an index in
      it; or a lone host was given part of the job's arguments.
    MultihostError: the metadata server did not answer within `timeout`.
  """
  if request.cluster_detection_method is not None or job.markers(environ):
    return None
  hosts = environ.get(_env.TPU_PROCESS_ADDRESSES)
  if hosts is None:
    hosts = environ.get(_env.TPU_WORKER_HOSTNAMES)
  if hosts is not None:
    return _from_host_list(environ, request, hosts.split(','))
  if (_env.TPU_SKIP_MDS_QUERY in environ or
      importlib.util.find_spec('libtpu') is None):
    return None  # JAX's GCE detection would not ask either.
  answer = _from_metadata(environ, timeout)
  if answer is Metadata.NOT_A_POD_HOST:
    return None
  if answer is Metadata.LONE_HOST:
    return _lone(environ, request, 'the metadata server: ' + answer.value)
  # A GCE TPU pod host: JAX's own detection asks the server for the rest.
  return jax_detection.detect(
      environ, dataclasses.replace(request, cluster_detection_method='gcetpu'),
      engine=ENGINE,
      why="the metadata server: a TPU pod host; JAX's gcetpu detection")


def _lone(environ: Mapping[str, str], request: job.Request,
          why: str) -> job.JobDescription | None:
  if job.in_indexed_job(environ):
    return None
  return job.single(request, engine=ENGINE, why=why)


def _from_host_list(environ: Mapping[str, str], request: job.Request,
                    hosts: list[str]) -> job.JobDescription | None:
  """`detect` where the environment lists the slice's hosts (GKE, or a lone machine)."""
  env = environ
  slices = int(env.get(_env.MEGASCALE_NUM_SLICES) or 1)
  if len(hosts) == 1 and slices == 1:
    return _lone(environ, request,
                 f'a lone TPU host: ${_env.TPU_WORKER_HOSTNAMES} names one '
                 'host, one slice')
  worker = env.get(_env.TPU_WORKER_ID, '')
  if not worker.isdigit() or int(worker) >= len(hosts):
    raise ValueError(
        f'{_env.TPU_WORKER_HOSTNAMES} names {len(hosts)} TPU hosts, but '
        f'{_env.TPU_WORKER_ID}={worker!r} is not an index among them. Set '
        f'{_env.TPU_WORKER_ID} to this host\'s index (0 to {len(hosts) - 1}), '
        'or pass coordinator_address, num_processes and process_id.')
  address = env.get(_env.MEGASCALE_COORDINATOR_ADDRESS) or hosts[0]
  port = env.get(_env.COORDINATOR_PORT) or JAX_TPU_PORT
  slice_id = int(env.get(_env.MEGASCALE_SLICE_ID) or 0)
  return job.found(
      request, coordinator_address=f'{address.split(":")[0]}:{port}',
      num_processes=len(hosts) * slices,
      process_id=int(worker) + slice_id * len(hosts),
      local_device_ids=jax_detection.local_device_ids(environ, request),
      engine=ENGINE,
      why=(f'a TPU pod host: {len(hosts)} hosts a slice, {slices} '
           f'slice(s); ${_env.TPU_WORKER_ID}={worker}'))


def _from_metadata(env: Mapping[str, str], timeout: float) -> Metadata:
  """`find` on a TPU VM without a host list: asks the GCE metadata server, as JAX would, within `timeout` seconds."""
  server = env.get(_env.GCE_METADATA_IP) or 'metadata.google.internal'
  answers: dict[str, tuple[int, str]] = {}
  failed: list[BaseException] = []

  def ask():
    for key in ('agent-worker-number', 'worker-network-endpoints', 'tpu-env'):
      try:
        answers[key] = _get(server, key, timeout)
      except BaseException as e:  # pylint: disable=broad-except
        failed.append(e)
        return
      if answers[key][0] != 200:
        return

  asker = threading.Thread(target=ask, name='tpu-metadata', daemon=True)
  asker.start()
  asker.join(timeout)
  if asker.is_alive() or failed:
    why = (f'{type(failed[0]).__name__}: {failed[0]}' if failed else
           f'no answer within {timeout:g} s')
    raise errors.MultihostError(
        f'This machine has a TPU runtime (libtpu) and no TPU host list '
        f'({_env.TPU_WORKER_HOSTNAMES}), so JAX would ask the GCE metadata '
        f'server (http://{server}) whether it is a TPU pod host, and that '
        f'server did not answer ({why}). On a lone TPU machine outside '
        f'Google Cloud, set {_env.TPU_SKIP_MDS_QUERY}=1 (or '
        f'{_env.TPU_WORKER_HOSTNAMES}=localhost) to run as one controller; '
        'on a Cloud TPU VM, check its network, or pass coordinator_address, '
        'num_processes and process_id to initialize().')
  if answers['agent-worker-number'][0] != 200:
    return Metadata.NOT_A_POD_HOST  # JAX's answer too.
  endpoints = answers.get('worker-network-endpoints', (0, ''))[1]
  slices = [line.split(':', 1)[1].strip().strip("'")
            for line in answers.get('tpu-env', (0, ''))[1].splitlines()
            if line.split(':', 1)[0].strip() == _env.MEGASCALE_NUM_SLICES]
  if len(endpoints.split(',')) == 1 and (not slices or slices[0] in ('', '1')):
    return Metadata.LONE_HOST
  return Metadata.POD_HOST


def _get(server: str, key: str, timeout: float) -> tuple[int, str]:
  """(HTTP status, body) of the metadata server's instance attribute `key`."""
  request = urllib.request.Request(
      f'http://{server}/computeMetadata/v1/instance/attributes/{key}',
      headers={'Metadata-Flavor': 'Google'})
  try:
    with urllib.request.urlopen(request, timeout=timeout) as response:
      return response.status, response.read().decode()
  except urllib.error.HTTPError as e:
    return e.code, ''

