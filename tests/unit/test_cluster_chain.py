"""The one cluster detection (`multihost._src.clusters.chain`): its order, each engine's description, and process 0's wait for its own name in a Kubernetes pod.

Each engine reads a plain mapping (no process environment changed), except
where JAX's own detection, which reads `os.environ`, is the yardstick.
"""

from __future__ import annotations

import importlib.util
import logging
import pathlib
import socket

from jax._src import clusters as jax_clusters
import pytest

from multihost import env as env_lib
from multihost._src.api import initialize as initialize_lib
from multihost._src.clusters import alone
from multihost._src.clusters import chain
from multihost._src.clusters import explicit
from multihost._src.clusters import jax_detection
from multihost._src.clusters import job
from multihost._src.clusters import kubernetes
from multihost._src.clusters import openmpi
from multihost._src.clusters import pmix
from multihost._src.clusters import prrte
from multihost._src.clusters import slurm
from multihost._src.clusters import tpu
from multihost._src.runtime import errors

ROOT = pathlib.Path(__file__).resolve().parents[2]

SLURM = {env_lib.SLURM_JOB_ID: '4242', env_lib.SLURM_STEP_NODELIST:
         'node[003-007],login1', env_lib.SLURM_NTASKS: '4',
         env_lib.SLURM_PROCID: '2', env_lib.SLURM_LOCALID: '1'}
OMPI4 = {env_lib.OMPI_HNP_URI:
         '1531576320.0;tcp://10.96.0.1,10.148.0.1:34911',
         env_lib.OMPI_SIZE: '2', env_lib.OMPI_RANK: '1',
         env_lib.OMPI_LOCAL_RANK: '1'}
OMPI5 = {env_lib.OMPI_SIZE: '2', env_lib.OMPI_RANK: '1',
         env_lib.OMPI_LOCAL_RANK: '1', env_lib.OMPI_LOCAL_SIZE: '2',
         env_lib.PRTE_LAUNCHED: '1', env_lib.PMIX_NAMESPACE: 'prterun-vm-7@1'}
POD = {env_lib.K8S_SERVICE_HOST: '10.96.0.1',
       env_lib.JOB_COMPLETION_INDEX: '1'}
LAUNCHER = {env_lib.COORDINATOR: '127.0.0.1:1234',
            env_lib.NUM_PROCESSES: '2', env_lib.PROCESS_ID: '1'}
TPU_POD = {env_lib.TPU_WORKER_HOSTNAMES: 'h0,h1', env_lib.TPU_WORKER_ID: '1'}


def _describe(environ, **asked):
  return chain.describe(environ, job.Request.of(environ, **asked))


def _no_libpmix():
  if pmix.available():
    pytest.skip('a libpmix loads here: Open MPI 5 would use it')


def test_the_chain_is_in_its_documented_order():
  assert [e.__module__.rsplit('.', 1)[1] for e in chain.ENGINES] == [
      'explicit', 'kubernetes', 'prrte', 'openmpi', 'slurm', 'tpu', 'alone',
      'jax_detection']


@pytest.mark.parametrize('environ, engine', [
    ({**LAUNCHER, **SLURM, **OMPI4, **TPU_POD}, explicit.ENGINE),
    ({**POD, **SLURM, env_lib.COORDINATOR: 'job-0.svc:1234',
      env_lib.NUM_PROCESSES: '2'}, kubernetes.ENGINE),
    ({**OMPI4, **SLURM}, openmpi.ENGINE),  # JAX's order too.
    ({**SLURM, **TPU_POD}, slurm.ENGINE),
    (TPU_POD, tpu.ENGINE),
    ({}, alone.ENGINE),
])
def test_the_first_engine_that_finds_the_job_describes_it(environ, engine):
  assert _describe(environ).engine == engine


def test_an_engine_after_the_one_that_answered_is_not_asked():
  asked = []

  def engine(name, answer):
    def detect(environ, request):
      del environ, request
      asked.append(name)
      return answer
    return detect

  answer = job.JobDescription('h:1', 2, 0, None, 'b', 'test')
  got = chain.describe({}, job.Request(), engines=(
      engine('a', None), engine('b', answer), engine('c', None)))
  assert got is answer and asked == ['a', 'b']


def test_the_job_as_given_names_where_each_value_came_from():
  environ = {**LAUNCHER, env_lib.LOCAL_DEVICE_IDS: '0,1'}
  got = _describe(environ, num_processes=3)
  assert (got.coordinator_address, got.num_processes, got.process_id,
          got.local_device_ids) == ('127.0.0.1:1234', 3, 1, (0, 1))
  assert got.why == ('given: $JAX_COORDINATOR_ADDRESS, num_processes, '
                     '$JAX_PROCESS_ID, $JAX_LOCAL_DEVICE_IDS')
  assert got.jax_arguments() == dict(
      coordinator_address='127.0.0.1:1234', num_processes=3, process_id=1,
      local_device_ids=[0, 1], cluster_detection_method='deactivate')
  with pytest.raises(ValueError, match=r'process_id=5, num_processes=2'):
    _describe(LAUNCHER, process_id=5)


def test_a_job_given_whole_inside_slurm_keeps_jaxs_device_of_the_task():
  # JAX restricts a Slurm task to its local device even when the job is
  # given (`multihost.launch` under `srun`): so does the description.
  assert _describe({**LAUNCHER, **SLURM}).local_device_ids == (1,)
  assert _describe(LAUNCHER).local_device_ids is None


def test_an_indexed_job_given_its_coordinator_and_count_takes_its_index():
  environ = {**POD, env_lib.COORDINATOR: 'job-0.svc:1234',
             env_lib.NUM_PROCESSES: '2'}
  got = kubernetes.detect(environ, job.Request.of(environ))
  assert (got.coordinator_address, got.num_processes, got.process_id,
          got.engine) == ('job-0.svc:1234', 2, 1, 'kubernetes')
  assert '$JOB_COMPLETION_INDEX=1' in got.why
  with pytest.raises(ValueError, match=r'process_id=7, num_processes=2'):
    kubernetes.detect({**environ, env_lib.JOB_COMPLETION_INDEX: '7'},
                      job.Request.of(environ))
  assert kubernetes.detect(POD, job.Request.of(POD)) is None  # No count.


def test_open_mpi_5_on_one_host_without_pmix_uses_the_namespaces_port():
  _no_libpmix()
  got = prrte.detect(OMPI5, job.Request.of(OMPI5))
  assert got.coordinator_address == (
      f'127.0.0.1:{prrte.derived_port("prterun-vm-7@1")}')
  assert (got.num_processes, got.process_id, got.local_device_ids,
          got.engine) == (2, 1, (1,), 'open-mpi-5')
  assert "without PMIx" in got.why
  given = prrte.detect(OMPI5, job.Request(coordinator_address='h:5',
                                          local_device_ids=(0,)))
  assert (given.coordinator_address, given.local_device_ids) == ('h:5', (0,))
  # A detection method asked: JAX's detection by it, not this engine.
  assert prrte.detect(OMPI5, job.Request(
      cluster_detection_method='mpi4py')) is None


def _jax_answer(monkeypatch, environ):
  """JAX's own detection's answer for `environ` (the yardstick)."""
  for name in (*SLURM, *OMPI4, *OMPI5, env_lib.COORDINATOR_PORT):
    monkeypatch.delenv(name, raising=False)
  for name, value in environ.items():
    monkeypatch.setenv(name, value)
  address, count, index, local = (
      jax_clusters.ClusterEnv.auto_detect_unset_distributed_params(
          None, None, None, None, None, 10))
  return address, count, index, None if local is None else tuple(local)


@pytest.mark.parametrize('nodes', ['node001', 'node001,host2',
                                   'node[001-0015],host2',
                                   'node[001,007-015],host2', 'a[7]'])
@pytest.mark.parametrize('port', [None, '7777'])
def test_slurm_gives_jaxs_answer(monkeypatch, nodes, port):
  environ = {**SLURM, env_lib.SLURM_STEP_NODELIST: nodes}
  if port:
    environ[env_lib.COORDINATOR_PORT] = port
  got = slurm.detect(environ, job.Request.of(environ))
  assert got.engine == 'slurm'
  assert (got.coordinator_address, got.num_processes, got.process_id,
          got.local_device_ids) == _jax_answer(monkeypatch, environ)


@pytest.mark.parametrize('uri', [
    '1531576320.0;tcp://10.96.0.1,10.148.0.1,10.108.0.1:34911',
    '1314521088.0;tcp6://[fe80::b9b:ac5d:9cf0:b858,2620:10d:c083::2]:43370',
    '4096.0;tcp://127.0.0.1:50000'])
@pytest.mark.parametrize('port', [None, '7777'])
def test_open_mpi_4_gives_jaxs_answer(monkeypatch, uri, port):
  environ = {**OMPI4, env_lib.OMPI_HNP_URI: uri}
  if port:
    environ[env_lib.COORDINATOR_PORT] = port
  got = openmpi.detect(environ, job.Request.of(environ))
  assert got.engine == 'open-mpi-4'
  assert (got.coordinator_address, got.num_processes, got.process_id,
          got.local_device_ids) == _jax_answer(monkeypatch, environ)


def test_no_cluster_is_a_single_controller_and_half_a_job_is_refused():
  got = alone.detect({}, job.Request())
  assert (got.distributed, got.num_processes, got.process_id,
          got.engine) == (False, 1, 0, 'single')
  with pytest.raises(ValueError, match=r"coordinator_address='h:1', "
                     r'num_processes=None, process_id=None'):
    alone.detect({}, job.Request(coordinator_address='h:1'))
  # A cluster's variables, or a method asked: JAX's detection decides.
  assert alone.detect({env_lib.SLURM_JOB_ID: '1'}, job.Request()) is None
  assert alone.detect(POD, job.Request()) is None
  assert alone.detect({}, job.Request(cluster_detection_method='x')) is None


def test_jaxs_detection_that_finds_no_coordinator_says_what_to_pass():
  # SLURM_JOB_ID alone (a batch script run without srun): a cluster's mark,
  # and no cluster JAX can read.
  with pytest.raises(ValueError, match=r'coordinator_address and '
                     r"num_processes and process_id should be defined: jax "
                     r"\(JAX's own cluster detection\)"):
    _describe({env_lib.SLURM_JOB_ID: '1'})
  got = jax_detection.detect({}, job.Request(
      coordinator_address='h:1', num_processes=2, process_id=1,
      cluster_detection_method='deactivate'))
  assert (got.coordinator_address, got.engine) == ('h:1', 'jax')


def test_an_indexed_job_without_the_kubernetes_client_says_what_to_do():
  if importlib.util.find_spec('kubernetes') is not None:
    pytest.skip('the kubernetes package is installed: JAX would use it')
  with pytest.raises(errors.MultihostError,
                     match=r"process 1: .*indexed Kubernetes Job.*pip install"):
    _describe(POD)


def test_initialize_finds_the_job_through_the_chain_alone():
  """`initialize` calls only `chain.describe`; JAX's detection is reached only through `clusters.jax_detection`."""
  source = (ROOT / 'multihost/_src/api/initialize.py').read_text()
  assert source.count('chain.describe(') == 1
  users = sorted(str(p.relative_to(ROOT)) for p in (ROOT / 'multihost').rglob(
      '*.py') if 'detect_cluster(' in p.read_text())
  assert users == ['multihost/_src/clusters/jax_detection.py',
                   'multihost/_src/runtime/coordination.py']


class _Resolver:
  """`socket.getaddrinfo` that fails `failures` times, then answers 127.0.0.1; on a fake clock."""

  def __init__(self, failures: int):
    self.failures = failures
    self.calls = 0
    self.now = 0.0

  def __call__(self, host, port, **kwargs):
    del kwargs
    self.calls += 1
    if self.calls <= self.failures:
      raise socket.gaierror(socket.EAI_NONAME, 'Name or service not known')
    return [(socket.AF_INET, socket.SOCK_STREAM, 6, '', ('127.0.0.1', port))]

  def sleep(self, seconds):
    self.now += seconds

  def clock(self):
    return self.now


def test_process_0_in_a_pod_waits_for_its_own_name_saying_so(caplog):
  resolver = _Resolver(failures=100)  # 50 s at one try each 0.5 s.
  with caplog.at_level(logging.WARNING):
    infos = kubernetes.await_own_name(
        'job-0.svc', 1234, timeout=300, resolve=resolver,
        sleep=resolver.sleep, clock=resolver.clock)
  assert infos[0][4] == ('127.0.0.1', 1234)
  assert resolver.calls == 101 and resolver.now == pytest.approx(50)
  said = [r.getMessage() for r in caplog.records if 'waiting' in
          r.getMessage()]
  assert len(said) == 2, said  # At once, then after 30 s.
  assert said[0].startswith("process 0: waiting for its own coordinator host "
                            "'job-0.svc' to resolve"), said


def test_process_0_whose_name_never_resolves_names_it_and_the_timeout():
  resolver = _Resolver(failures=10**9)
  with pytest.raises(errors.MultihostError,
                     match=r"process 0: its own coordinator host 'job-0.svc' "
                     r'.* did not resolve within the initialization timeout '
                     r'of 300 s \(last lookup: .*Name or service not known'):
    kubernetes.await_own_name('job-0.svc', 1234, timeout=300,
                              resolve=resolver, sleep=resolver.sleep,
                              clock=resolver.clock)
  assert resolver.now == pytest.approx(300)


def test_process_0s_bind_address_waits_in_a_pod_only(monkeypatch):
  monkeypatch.setattr(kubernetes, 'RESOLVE_EVERY_S', 0.01)
  resolver = _Resolver(failures=3)
  assert initialize_lib._bind_address(
      'job-0.svc:1234', wait_s=10, resolve=resolver) == '127.0.0.1:1234'
  assert resolver.calls == 4
  with pytest.raises(ValueError, match=r'cannot bind the coordination '
                     r"service to the host of coordinator_address="
                     r"'job-0.svc:1234'"):
    initialize_lib._bind_address('job-0.svc:1234', resolve=_Resolver(1))


def test_process_0_waits_for_its_name_within_initialization_timeout_in_a_pod(
    monkeypatch):
  monkeypatch.setattr(kubernetes, 'RESOLVE_EVERY_S', 0.01)
  monkeypatch.delenv(env_lib.EXTERNAL_SERVICE, raising=False)

  def kwargs(index=0):
    return dict(coordinator_address='job-0.svc:1234', process_id=index,
                initialization_timeout=300)

  in_pod = kwargs()
  initialize_lib._set_bind_address(in_pod, None, POD,
                                   resolve=_Resolver(failures=3))
  assert in_pod['coordinator_bind_address'] == '127.0.0.1:1234'
  assert 298 <= in_pod['initialization_timeout'] <= 300
  with pytest.raises(ValueError, match=r'cannot bind the coordination'):
    initialize_lib._set_bind_address(kwargs(), None, {},  # Not in a pod.
                                     resolve=_Resolver(failures=3))
  other = kwargs(index=1)  # Only process 0 binds.
  initialize_lib._set_bind_address(other, None, POD, resolve=_Resolver(10**9))
  assert 'coordinator_bind_address' not in other
