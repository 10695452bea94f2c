r"""Runs N JAX controllers of a command on this machine.

  python bin/launch.py --num_processes=2 --devices_per_process=2 \
      [--timeout=600] [--grace_period=15] [--host_service] -- python bin/train.py --flag=...

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
_HOST_SERVICE = flags.DEFINE_bool(
    'host_service', False, 'Host the JAX coordination service in the '
    'launcher, so that a death of process 0 is reported like any other '
    '(the command must use multihost.initialize()).')


def main(argv: list[str]) -> int:
  command = argv[1:]
  if not command:
    raise app.UsageError(
        'Give the command after --, e.g. '
        'bin/launch.py --num_processes=2 -- python bin/train.py')
  return launch.run_cli(command, num_processes=_NUM_PROCESSES.value,
                        devices_per_process=_DEVICES_PER_PROCESS.value,
                        timeout=_TIMEOUT.value,
                        grace_period=_GRACE_PERIOD.value,
                        host_service=_HOST_SERVICE.value)


if __name__ == '__main__':
  flags.mark_flag_as_required('num_processes')
  app.run(main)
