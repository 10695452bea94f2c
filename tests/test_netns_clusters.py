"""Controllers across simulated hosts started the way Slurm and Open MPI start them: `multihost.initialize()` with no arguments and no coordinator address."""

from __future__ import annotations

import os
import subprocess

from _helpers import program
from _helpers import stop
import pytest

from multihost import env as mh_env
from multihost import netns

_OK, _WHY = netns.available()
pytestmark = pytest.mark.skipif(not _OK, reason=_WHY or 'no simulated hosts')

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PORT = 23456

def _base_env() -> dict[str, str]:
  """This environment without any launcher's or scheduler's variables."""
  drop = ('JAX_', 'OMPI_', 'SLURM_', 'MULTIHOST_')
  env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
  env.update({'PYTHONPATH': _ROOT, mh_env.NUM_CPU_DEVICES: '1',
              mh_env.PLATFORMS: 'cpu', mh_env.COORDINATOR_PORT: str(_PORT),
              mh_env.HEARTBEAT: '5'})
  return env


def _slurm(net, i, n):
  return {mh_env.SLURM_JOB_ID: '4242',
          mh_env.SLURM_STEP_NODELIST: ','.join(net.address(k)
                                               for k in range(n)),
          mh_env.SLURM_NTASKS: str(n), mh_env.SLURM_PROCID: str(i),
          mh_env.SLURM_LOCALID: '0'}


def _ompi(net, i, n):
  host = net.address(0)
  return {mh_env.OMPI_HNP_URI: f'{_PORT << 12}.0;tcp://{host}:{_PORT}',
          mh_env.OMPI_SIZE: str(n), mh_env.OMPI_RANK: str(i),
          mh_env.OMPI_LOCAL_RANK: '0', mh_env.OMPI_LOCAL_SIZE: '1'}


@pytest.mark.parametrize('scheduler,companion', [
    ('slurm', False), ('ompi', False), ('slurm', True)])
def test_initialize_picks_up_the_schedulers_variables_across_hosts(
    scheduler, companion):
  n = 2
  with netns.SimulatedHosts(n) as net:
    procs = []
    for i in range(n):
      env = _base_env()
      env.update((_slurm if scheduler == 'slurm' else _ompi)(net, i, n))
      if companion:
        env[mh_env.COMPANION_SERVICE] = '1'
      procs.append(subprocess.Popen(
          net.command(i, program('scheduler_hosts')), env=env,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
      for p in procs:
        outs.append(p.communicate(timeout=120)[0])
    finally:
      for p in procs:
        stop(p)
    codes = [p.returncode for p in procs]
    # Nothing is left inside host 0 (with companion: it left with process 0).
    left = subprocess.run(['ip', 'netns', 'pids', net.namespace(0)],
                          capture_output=True, text=True,
                          timeout=30).stdout.split()
    assert codes == [0] * n, '\n\n'.join(o[-3000:] for o in outs)
    assert left == []
    want = [net.address(k) for k in range(n)]
    for i, out in enumerate(outs):
      line = out.split('RESULT ', 1)[1].splitlines()[0]
      assert line == f'{i} {n} {want!r}', line
