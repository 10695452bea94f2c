"""A JAX controller: on attempt 0 process 1 exits 3 before `jax.distributed.initialize`; on attempt 1 all meet."""

from __future__ import annotations

import os
import sys

from multihost import env as env_lib  # (no JAX import: names load lazily)


def main() -> None:
  attempt = int(os.environ[env_lib.RESTART_COUNT])
  if attempt == 0 and os.environ[env_lib.PROCESS_ID] == '1':
    sys.exit(3)
  # Only the processes that go on import JAX.
  import jax  # noqa: PLC0415
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), 'programs'))
  import _jax_gather  # noqa: PLC0415  (tests/programs's, found by path)

  jax.distributed.initialize()
  got = _jax_gather.process_indices()
  # One write per line (see tests/multiprocess/test_launch.py: gloo writes to fd 1 too).
  os.write(1, (f'facts {jax.process_index()} {jax.process_count()} '
               f'{jax.device_count()} {got} attempt '
               f'{attempt}\n').encode())


if __name__ == '__main__':
  main()
