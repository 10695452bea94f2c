r"""Runs N JAX controllers of a command on this machine.

  python bin/launch.py --num_processes=2 --devices_per_process=2 \
      [--timeout=600] [--grace_period=5] -- python bin/train.py --flag=...

Each controller can call `multihost.initialize()` or a bare
`jax.distributed.initialize()` unchanged. Output lines are prefixed with the
process index; the first failure stops the run and sets the exit status; a
summary is printed at the end. See `multihost.launch`.
"""

from __future__ import annotations

from absl import app
from absl import flags

from multihost import launch

_NUM_PROCESSES = flags.DEFINE_integer(
    'num_processes', None, 'Number of controllers to start.', lower_bound=1)
_DEVICES_PER_PROCESS = flags.DEFINE_integer(
    'devices_per_process', 1, 'CPU devices per controller.', lower_bound=1)
_TIMEOUT = flags.DEFINE_float(
    'timeout', None, 'Seconds for the whole run; on expiry every process is '
    'stopped and the exit status is 124.', lower_bound=0)
_GRACE_PERIOD = flags.DEFINE_float(
    'grace_period', launch.DEFAULT_GRACE_PERIOD_S,
    'Seconds the other processes get to finish after the first failure.',
    lower_bound=0)


def main(argv: list[str]) -> int:
  command = argv[1:]
  if not command:
    raise app.UsageError(
        'Give the command after --, e.g. '
        'bin/launch.py --num_processes=2 -- python bin/train.py')
  return launch.run_cli(command, num_processes=_NUM_PROCESSES.value,
                        devices_per_process=_DEVICES_PER_PROCESS.value,
                        timeout=_TIMEOUT.value,
                        grace_period=_GRACE_PERIOD.value)


if __name__ == '__main__':
  flags.mark_flag_as_required('num_processes')
  app.run(main)
