"""Clusters: a Slurm job step (`srun`), read from its variables as JAX's `slurm` detection reads them.

The coordinator is the step's first node, on `$JAX_COORDINATOR_PORT` or a
port derived from the job id (JAX's range); the count, index and local index
are `SLURM_NTASKS`, `SLURM_PROCID` and `SLURM_LOCALID`.
tests/unit/test_clusters.py holds these to JAX's own answers.
"""

from __future__ import annotations

from collections.abc import Mapping

from multihost import env as _env
from multihost._src.clusters import job
from multihost._src.runtime import coordination

ENGINE = 'slurm'
_NEEDED = (_env.SLURM_JOB_ID, _env.SLURM_STEP_NODELIST, _env.SLURM_NTASKS,
           _env.SLURM_PROCID, _env.SLURM_LOCALID)


def first_node(node_list: str) -> str:
  """The first host of a Slurm node list ('node001', 'node[001-015],h2', 'node[001,007-015]')."""
  cut = next((i for i, ch in enumerate(node_list) if ch in ',['),
             len(node_list))
  if cut == len(node_list) or node_list[cut] == ',':
    return node_list[:cut]
  suffix = node_list[cut + 1:]
  end = next((i for i, ch in enumerate(suffix) if ch in ',-'), None)
  return node_list[:cut] + suffix[:end]


def detect(environ: Mapping[str, str],
           request: job.Request) -> job.JobDescription | None:
  """The job of a Slurm step, the request's values kept; None outside one."""
  if (request.cluster_detection_method is not None or
      any(name not in environ for name in _NEEDED)):
    return None  # A method asked: JAX's detection by it.
  port = (environ.get(_env.COORDINATOR_PORT) or
          str(int(environ[_env.SLURM_JOB_ID]) % 2**12 + (65535 - 2**12 + 1)))
  return job.found(
      request,
      coordinator_address=(
          f'{first_node(environ[_env.SLURM_STEP_NODELIST])}:{port}'),
      num_processes=int(environ[_env.SLURM_NTASKS]),
      process_id=int(environ[_env.SLURM_PROCID]),
      local_device_ids=local_device_ids(environ),
      engine=ENGINE,
      why=(f'a Slurm step: ${_env.SLURM_STEP_NODELIST}, ${_env.SLURM_NTASKS}, '
           f'${_env.SLURM_PROCID}, ${_env.SLURM_LOCALID}'))


def local_device_ids(environ: Mapping[str, str]) -> list[int] | None:
  """This task's device in a Slurm step (JAX's rule: its local index, none on a Cloud TPU VM); None outside one."""
  if any(name not in environ for name in _NEEDED):
    return None
  if coordination.running_on_cloud_tpu_vm():
    return None
  return [int(environ[_env.SLURM_LOCALID])]
