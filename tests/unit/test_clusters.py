"""What `multihost.initialize()` makes of an engine's environment before JAX: Open MPI 5 (PRRTE), Kubernetes.

The runs under a real `mpirun` are in tests/multiprocess/test_openmpi.py,
and 2 controllers of an indexed Job's environment in
tests/multiprocess/test_kubernetes_env.py; here, the pieces that need no
second process.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import socket
import threading
import time

import jax
import pytest

import multihost
from multihost import env as env_lib
from multihost._src.clusters import job
from multihost._src.clusters import prrte
from multihost._src.clusters import tpu as tpu_cluster
from multihost._src.runtime import errors

# Open MPI 5's launcher, as seen by rank 1 of 2 on one host.
_PRRTE = {env_lib.OMPI_SIZE: '2', env_lib.OMPI_RANK: '1',
          env_lib.OMPI_LOCAL_RANK: '1', env_lib.OMPI_LOCAL_SIZE: '2',
          env_lib.PRTE_LAUNCHED: '1',
          env_lib.PMIX_NAMESPACE: 'prterun-vm-4242@1'}
_ENGINE_VARS = (*env_lib.CLUSTER_MARKERS, *_PRRTE, env_lib.COORDINATOR,
                env_lib.NUM_PROCESSES, env_lib.PROCESS_ID,
                env_lib.K8S_SERVICE_HOST, env_lib.JOB_COMPLETION_INDEX)


@pytest.fixture
def bare(monkeypatch):
  """No engine's variables in the environment."""
  for name in _ENGINE_VARS:
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


def test_open_mpi_5_is_told_from_open_mpi_4():
  assert not prrte.launched({})
  assert prrte.launched(_PRRTE)
  # Open MPI 4: clusters.openmpi.
  assert not prrte.launched({**_PRRTE, env_lib.OMPI_HNP_URI:
                             '4096.0;tcp://127.0.0.1:50000'})


def test_the_derived_port_is_the_jobs_own_and_in_jaxs_range():
  ports = {prrte.derived_port(f'prterun-vm-{pid}@1') for pid in range(100)}
  assert all(61440 <= p <= 65535 for p in ports)
  assert len(ports) > 90  # Different jobs, different ports (mostly).
  assert prrte.derived_port('prterun-vm-7@1') == prrte.derived_port(
      'prterun-vm-7@1')


def test_process_0_on_one_host_listens_on_loopback_on_a_held_port():
  address, hold = prrte.first_address(single_host=True, hostname='anything',
                                      port=None)
  try:
    host, port = address.rsplit(':', 1)
    assert host == '127.0.0.1' and int(port) == hold.getsockname()[1]
    # The service still binds it (SO_REUSEPORT, as JAX's does).
    with socket.socket() as service:
      service.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
      service.bind(('127.0.0.1', int(port)))
  finally:
    hold.close()
  assert prrte.first_address(single_host=True, hostname='x',
                             port='12345') == ('127.0.0.1:12345', None)


def test_process_0_across_hosts_refuses_a_host_name_that_is_loopback():
  with pytest.raises(errors.MultihostError,
                     match=r"'localhost' resolves to 127\.0\.0\.1, a loopback "
                     r'address .*JAX_COORDINATOR_ADDRESS'):
    prrte.first_address(single_host=False, hostname='localhost', port=None)
  with pytest.raises(errors.MultihostError,
                     match=r'cannot resolve its own host name .*'
                     r'JAX_COORDINATOR_ADDRESS'):
    prrte.first_address(single_host=False, hostname='no-such-host.invalid',
                        port=None)


def test_a_pod_that_is_no_indexed_job_runs_as_one_controller(bare):
  bare.setenv(env_lib.K8S_SERVICE_HOST, '10.96.0.1')  # In every pod.
  multihost.initialize()
  assert not jax.distributed.is_initialized()


def test_an_indexed_job_without_the_kubernetes_client_says_what_to_do(bare):
  if importlib.util.find_spec('kubernetes') is not None:
    pytest.skip('the kubernetes package is installed: JAX would use it')
  bare.setenv(env_lib.K8S_SERVICE_HOST, '10.96.0.1')
  bare.setenv(env_lib.JOB_COMPLETION_INDEX, '3')
  with pytest.raises(errors.MultihostError,
                     match=r"process 3: .*indexed Kubernetes Job.*pip install "
                     r"'jax\[k8s\]'.*JAX_COORDINATOR_ADDRESS.*"
                     r'JAX_NUM_PROCESSES'):
    multihost.initialize()
  assert not jax.distributed.is_initialized()


@contextlib.contextmanager
def _metadata_server(attributes: dict[str, str]):
  """A GCE metadata server on 127.0.0.1 serving instance `attributes` (404 for others); its address."""

  class Handler(http.server.BaseHTTPRequestHandler):

    def do_GET(self):  # pylint: disable=invalid-name
      key = self.path.rsplit('/', 1)[-1]
      ok = (key in attributes and
            self.headers.get('Metadata-Flavor') == 'Google')
      body = attributes.get(key, '').encode()
      self.send_response(200 if ok else 404)
      self.send_header('Content-Length', str(len(body) if ok else 0))
      self.end_headers()
      if ok:
        self.wfile.write(body)

    def log_message(self, *args):
      del args

  server = http.server.HTTPServer(('127.0.0.1', 0), Handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield f'127.0.0.1:{server.server_address[1]}'
  finally:
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_a_tpu_vm_asks_the_metadata_server_as_jax_would():
  pod = {'agent-worker-number': '1', 'worker-network-endpoints': 'a,b',
         'tpu-env': "ACCELERATOR_TYPE: 'v5litepod-8'\n"}
  metadata = tpu_cluster.Metadata
  for attributes, want in ((pod, metadata.POD_HOST),
                           ({**pod, 'worker-network-endpoints': 'a'},
                            metadata.LONE_HOST),
                           ({**pod, 'worker-network-endpoints': 'a',
                             'tpu-env': "MEGASCALE_NUM_SLICES: '2'\n"},
                            metadata.POD_HOST),
                           ({}, metadata.NOT_A_POD_HOST)):
    with _metadata_server(attributes) as server:
      got = tpu_cluster._from_metadata(
          {env_lib.GCE_METADATA_IP: server}, timeout=10)
    assert got == want, (attributes, got)


def test_a_metadata_server_that_never_answers_is_named_in_time():
  with socket.socket() as silent:
    silent.bind(('127.0.0.1', 0))
    silent.listen(4)
    address = f'127.0.0.1:{silent.getsockname()[1]}'
    t0 = time.monotonic()
    with pytest.raises(errors.MultihostError,
                       match=rf'metadata server \(http://{address}\) .*'
                       r'TPU_SKIP_MDS_QUERY=1'):
      tpu_cluster._from_metadata({env_lib.GCE_METADATA_IP: address},
                                 timeout=1.0)
  assert time.monotonic() - t0 < 5


def _tpu(env, request=None):
  """(coordinator, count, index, engine) of `clusters.tpu` for `env`."""
  found = tpu_cluster.detect(env, request or job.Request())
  return found and (found.coordinator_address, found.num_processes,
                    found.process_id, found.engine)


def test_one_host_of_a_two_slice_tpu_job_is_no_lone_controller():
  # Each slice a single host (its host list one name), two slices: two
  # controllers, never a lone one per host.
  for slice_id in (0, 1):
    assert _tpu({
        env_lib.TPU_WORKER_HOSTNAMES: 'localhost', env_lib.TPU_WORKER_ID: '0',
        env_lib.MEGASCALE_NUM_SLICES: '2',
        env_lib.MEGASCALE_SLICE_ID: str(slice_id),
        env_lib.MEGASCALE_COORDINATOR_ADDRESS: 'm0:8080'})[:3] == (
            'm0:8482', 2, slice_id)


def test_a_tpu_pods_host_list_gives_jaxs_numbers():
  env = {env_lib.TPU_WORKER_HOSTNAMES: 'h0,h1,h2,h3',
         env_lib.TPU_WORKER_ID: '2'}
  assert _tpu(env) == ('h0:8482', 4, 2, 'tpu')
  assert _tpu({**env, env_lib.MEGASCALE_NUM_SLICES: '2',
               env_lib.MEGASCALE_SLICE_ID: '1',
               env_lib.MEGASCALE_COORDINATOR_ADDRESS: 'm:1',
               env_lib.COORDINATOR_PORT: '9'}) == ('m:9', 8, 6, 'tpu')
  lone = {env_lib.TPU_WORKER_HOSTNAMES: 'localhost', env_lib.TPU_WORKER_ID: '0'}
  assert _tpu(lone) == (None, 1, 0, 'tpu')  # A single controller.
  with pytest.raises(ValueError, match=r"TPU_WORKER_ID='7' is not an index"):
    _tpu({**env, env_lib.TPU_WORKER_ID: '7'})
  # Given values are kept; a lone host given part of the job says so.
  assert _tpu(env, job.Request(process_id=3)) == ('h0:8482', 4, 3, 'tpu')
  with pytest.raises(ValueError, match=r'needs coordinator_address, '
                     r'num_processes and process_id together'):
    _tpu(lone, job.Request(num_processes=2))
