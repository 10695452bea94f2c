"""Controllers with a Cloud TPU host's environment: a lone TPU machine is one controller; a pod's hosts join as JAX numbers them.

A lone TPU machine (as the TPU machines lent to this project: one host,
`TPU_WORKER_HOSTNAMES=localhost`, `TPU_WORKER_ID=0`, no metadata server)
runs `multihost.initialize()` as a single controller, without
`jax.distributed` and without asking any server. Two processes with a
two-host slice's environment (GKE's variables, both hosts on 127.0.0.1)
start `jax.distributed` with JAX's coordinator port (here
`JAX_COORDINATOR_PORT`), count and indexes, taken from the environment: on
CPU, JAX's own TPU detection would find no cluster (it needs a TPU VM), so
this shows that `initialize()` derives them itself. The metadata server's
address points at a socket that never answers: a lookup would hang there.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time

import _helpers

from multihost import env as env_lib

TIMEOUT_S = 120
_ALONE = ('import jax, multihost; multihost.initialize(); '
          'print("initialized", jax.distributed.is_initialized(), '
          'jax.process_count())')


@contextlib.contextmanager
def _silent_server():
  """An address that accepts connections and never answers."""
  with socket.socket() as server:
    server.bind(('127.0.0.1', 0))
    server.listen(8)
    yield f'127.0.0.1:{server.getsockname()[1]}'


def _tpu_env(hosts: str, worker: int, metadata: str, **extra) -> dict:
  return _helpers.clean_env(**_helpers.quick_compile_env(), **{
      env_lib.PLATFORMS: 'cpu', env_lib.TPU_WORKER_HOSTNAMES: hosts,
      env_lib.TPU_WORKER_ID: str(worker), env_lib.GCE_METADATA_IP: metadata,
      **extra})


def test_a_lone_tpu_machine_is_one_controller_without_lookups():
  with _silent_server() as metadata:
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, '-c', _ALONE],
        env=_tpu_env('localhost', 0, metadata), stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  assert 'initialized False 1' in done.stdout, done.stdout
  assert time.monotonic() - t0 < 60


def test_the_hosts_of_a_tpu_pod_join_as_jax_numbers_them(tmp_path):
  script = tmp_path / 'swap_example.py'
  script.write_text(_helpers.readme_swap_example())
  with _helpers.held_port() as port, _silent_server() as metadata:
    codes, outs = _helpers.run_each(
        [sys.executable, str(script)],
        [_tpu_env('127.0.0.1,127.0.0.1', worker, metadata,
                  **{env_lib.COORDINATOR_PORT: str(port)})
         for worker in (1, 0)],
        cwd=tmp_path, timeout=TIMEOUT_S)
  assert codes == [0, 0], outs
  assert [o.strip().splitlines()[-1] for o in outs] == [
      'process 1: seed 1234, ids [0, 1]',
      'process 0: seed 1234, ids [0, 1]'], outs
