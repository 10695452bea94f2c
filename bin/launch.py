r"""Runs N JAX controllers of a command on this machine (the same command line as `python -m multihost.launch`).

  python bin/launch.py --num_processes=2 --devices_per_process=2 \
      [--timeout=600] [--grace_period=15] [--host_service] -- python bin/train.py --flag=...

Each controller can call `multihost.initialize()` or a bare
`jax.distributed.initialize()` unchanged. Output lines are prefixed with the
process index; the first failure stops the run and sets the exit status; a
summary is printed at the end. The flags are defined once, in
`multihost.launch` (`python bin/launch.py --help`).
"""

from __future__ import annotations

import sys

from multihost import launch

if __name__ == '__main__':
  sys.exit(launch.main(prog='bin/launch.py'))
