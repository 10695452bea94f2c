"""Two controllers with the environment of an indexed Kubernetes Job's pods, as docs/launcher.md gives it without the `kubernetes` package.

Each pod has `KUBERNETES_SERVICE_HOST` and its `JOB_COMPLETION_INDEX`; the
manifest adds `JAX_COORDINATOR_ADDRESS` and `JAX_NUM_PROCESSES`, and
`multihost.initialize()` takes the index from `JOB_COMPLETION_INDEX` (as
JAX's own Kubernetes detection does). No API server is reached (the
address given for it is never used); the coordinator is on 127.0.0.1
here, where a cluster has `JOB-0.SUBDOMAIN`. JAX's detection through the
Kubernetes API itself is not run here: it needs a cluster.
"""

from __future__ import annotations

import pathlib
import sys

import _helpers

from multihost import env as env_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def test_the_readme_example_in_an_indexed_jobs_environment(tmp_path):
  script = tmp_path / 'swap_example.py'
  script.write_text(_helpers.readme_swap_example())
  with _helpers.held_port() as port:
    codes, outs = _helpers.run_each(
        [sys.executable, str(script)],
        [_helpers.clean_env(**_helpers.quick_compile_env(), **{
            env_lib.PLATFORMS: 'cpu',
            env_lib.K8S_SERVICE_HOST: '10.96.0.1',
            env_lib.JOB_COMPLETION_INDEX: str(index),
            env_lib.COORDINATOR: f'127.0.0.1:{port}',
            env_lib.NUM_PROCESSES: '2'}) for index in (1, 0)],
        cwd=tmp_path, timeout=TIMEOUT_S)
  assert codes == [0, 0], outs
  assert [o.strip() for o in outs] == ['process 1: seed 1234, ids [0, 1]',
                                       'process 0: seed 1234, ids [0, 1]'], outs
