"""Controllers started on simulated hosts the way Slurm and Open MPI start them (shared by the cluster tests)."""

from __future__ import annotations

import os
import subprocess

from _helpers import program
from _helpers import stop

from multihost import env as mh_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def base_env(port: int, **extra: str) -> dict[str, str]:
  """This environment without any launcher's or scheduler's variables."""
  drop = ('JAX_', 'OMPI_', 'SLURM_', 'MULTIHOST_')
  env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
  env.update({'PYTHONPATH': ROOT, mh_env.NUM_CPU_DEVICES: '1',
              mh_env.PLATFORMS: 'cpu', mh_env.COORDINATOR_PORT: str(port),
              mh_env.HEARTBEAT: '5', **extra})
  return env


def slurm_env(net, i: int, n: int, *, job: str) -> dict[str, str]:
  return {mh_env.SLURM_JOB_ID: job,
          mh_env.SLURM_STEP_NODELIST: ','.join(net.address(k)
                                               for k in range(n)),
          mh_env.SLURM_NTASKS: str(n), mh_env.SLURM_PROCID: str(i),
          mh_env.SLURM_LOCALID: '0'}


def ompi_env(net, i: int, n: int, *, port: int) -> dict[str, str]:
  host = net.address(0)
  return {mh_env.OMPI_HNP_URI: f'{port << 12}.0;tcp://{host}:{port}',
          mh_env.OMPI_SIZE: str(n), mh_env.OMPI_RANK: str(i),
          mh_env.OMPI_LOCAL_RANK: '0', mh_env.OMPI_LOCAL_SIZE: '1'}


def run_on_hosts(net, n: int, name: str, *, scheduler: str, companion: bool,
                 port: int, job: str, **extra: str
                 ) -> tuple[list[subprocess.Popen], list[str]]:
  """Runs program `name` on hosts 0..n-1 with `scheduler`'s variables; returns the processes and their outputs.

  Bounded (120 s each); every process is stopped on every exit path.
  """
  procs = []
  try:
    for i in range(n):
      env = base_env(port, **extra)
      env.update(slurm_env(net, i, n, job=job) if scheduler == 'slurm'
                 else ompi_env(net, i, n, port=port))
      if companion:
        env[mh_env.COMPANION_SERVICE] = '1'
      procs.append(subprocess.Popen(
          net.command(i, program(name)), env=env,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs, [p.communicate(timeout=120)[0] for p in procs]
  finally:
    for p in procs:
      stop(p)
