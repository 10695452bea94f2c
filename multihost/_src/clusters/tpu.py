"""Cloud TPU: whether this machine is a lone TPU host or one host of a TPU pod, found as JAX's TPU cluster detection would, without unbounded network lookups.

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
  raises `MultihostError` saying what to set.
"""

from __future__ import annotations

from collections.abc import Mapping
import importlib.util
import threading
import urllib.error
import urllib.request

from multihost import env as _env
from multihost._src.runtime import errors

# JAX's coordinator port on a TPU pod (cloud_tpu_cluster.coordinator_port).
JAX_TPU_PORT = '8482'
METADATA_TIMEOUT_S = 5.0
SINGLE = 'single'  # A lone TPU host: one controller, no jax.distributed.
DETECT = 'detect'  # A GCE TPU pod host: JAX's own detection (it can ask).


def find(env: Mapping[str, str], *, timeout: float = METADATA_TIMEOUT_S
         ) -> None | str | tuple[str, int, int]:
  """What the TPU environment says about the job.

  Returns:
    None: no TPU cluster environment; `SINGLE`: a lone TPU host (one host,
    one slice); `DETECT`: a pod host of a GCE TPU VM whose metadata server
    answered (JAX's detection asks it again); (coordinator address,
    process count, process index): a pod host, from the environment.

  Raises:
    ValueError: the host list is set and TPU_WORKER_ID is not an index in it.
    MultihostError: the metadata server did not answer within `timeout`.
  """
  hosts = env.get(_env.TPU_PROCESS_ADDRESSES)
  if hosts is None:
    hosts = env.get(_env.TPU_WORKER_HOSTNAMES)
  if hosts is not None:
    return _from_host_list(env, hosts.split(','))
  if (_env.TPU_SKIP_MDS_QUERY in env or
      importlib.util.find_spec('libtpu') is None):
    return None  # JAX's GCE detection would not ask either.
  return _from_metadata(env, timeout)


def _from_host_list(env: Mapping[str, str], hosts: list[str]
                    ) -> str | tuple[str, int, int]:
  """`find` where the environment lists the slice's hosts (GKE, or a lone machine)."""
  slices = int(env.get(_env.MEGASCALE_NUM_SLICES) or 1)
  if len(hosts) == 1 and slices == 1:
    return SINGLE
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
  return (f'{address.split(":")[0]}:{port}', len(hosts) * slices,
          int(worker) + slice_id * len(hosts))


def _from_metadata(env: Mapping[str, str], timeout: float) -> str | None:
  """`find` on a TPU VM without a host list: asks the GCE metadata server, as JAX would, within `timeout` seconds."""
  server = env.get(_env.GCE_METADATA_IP) or 'metadata.google.internal'
  answers: dict[str, tuple[int, str] | BaseException] = {}

  def ask():
    for key in ('agent-worker-number', 'worker-network-endpoints', 'tpu-env'):
      try:
        answers[key] = _get(server, key, timeout)
      except BaseException as e:  # pylint: disable=broad-except
        answers[key] = e
        return
      if answers[key][0] != 200:
        return

  asker = threading.Thread(target=ask, name='tpu-metadata', daemon=True)
  asker.start()
  asker.join(timeout)
  if asker.is_alive() or any(isinstance(a, BaseException)
                             for a in answers.values()):
    failed = [a for a in answers.values() if isinstance(a, BaseException)]
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
    return None  # Not a TPU pod host (JAX's answer too).
  endpoints = answers.get('worker-network-endpoints', (0, ''))[1]
  slices = [line.split(':', 1)[1].strip().strip("'")
            for line in answers.get('tpu-env', (0, ''))[1].splitlines()
            if line.split(':', 1)[0].strip() == _env.MEGASCALE_NUM_SLICES]
  if len(endpoints.split(',')) == 1 and (not slices or slices[0] in ('', '1')):
    return SINGLE
  return DETECT


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

