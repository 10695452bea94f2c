"""Nothing multihost opens listens on every interface, under each cluster's auto-detection, in a network namespace of its own (`ss -ltn`)."""

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
_PORT = 23457
_EVERYWHERE = ('*:', '0.0.0.0:', '[::]:')


def _base_env() -> dict[str, str]:
  drop = ('JAX_', 'OMPI_', 'SLURM_', 'MULTIHOST_')
  env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
  env.update({'PYTHONPATH': _ROOT, mh_env.NUM_CPU_DEVICES: '1',
              mh_env.PLATFORMS: 'cpu', mh_env.COORDINATOR_PORT: str(_PORT),
              mh_env.HEARTBEAT: '5', mh_env.TIMEOUT: '30'})
  return env


def _slurm(net, i, n):
  return {mh_env.SLURM_JOB_ID: '4243',
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
def test_no_listener_on_every_interface_under_a_schedulers_variables(
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
          net.command(i, program('listeners')), env=env,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
      for p in procs:
        outs.append(p.communicate(timeout=120)[0])
    finally:
      for p in procs:
        stop(p)
    assert [p.returncode for p in procs] == [0] * n, '\n\n'.join(
        o[-3000:] for o in outs)
    listening = [l.split()[1] for l in outs[0].splitlines()
                 if l.startswith('LISTEN ')]
    # The coordination service (or its companion) and the data plane.
    host = net.address(0)
    assert {f'{host}:{_PORT}', f'[::ffff:{host}]:{_PORT}'} & set(listening), (
        outs[0])
    assert len(listening) >= 2, listening
    assert not [a for a in listening if a.startswith(_EVERYWHERE)], listening
