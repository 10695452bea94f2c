"""The launcher's one command line: its flags, and `main()` for `python -m multihost.launch` and `bin/launch.py`."""

from __future__ import annotations

import argparse
import collections.abc
import os
import sys

from multihost.launch._src.policy import policy as _policy
from multihost.launch._src.processes import environment as _environment
from multihost.launch._src.run import run as _run

PROG = 'python -m multihost.launch'


def split_command(argv: collections.abc.Sequence[str]
                  ) -> tuple[list[str], list[str]]:
  """Splits `[options..., '--', command...]` into options and command."""
  argv = list(argv)
  if '--' in argv:
    at = argv.index('--')
    return argv[:at], argv[at + 1:]
  return argv, []


def parser(prog: str = PROG) -> argparse.ArgumentParser:
  """The launcher's flags (the command follows `--`)."""
  p = argparse.ArgumentParser(
      prog=prog,
      description='Run N JAX controllers of a command on this machine.',
      usage='%(prog)s --num_processes=N [--devices_per_process=K] '
            '[--timeout=S] [--grace_period=S] [--max_restarts=N] '
            '[--compilation_cache_dir=DIR] [--log_dir=DIR] [--verbosity=N] '
            '[--host_service] [--trace=PATH] '
            '[--hosts=netns] -- COMMAND '
            '[ARGS...]')
  p.add_argument('--num_processes', type=int, required=True,
                 help='number of controllers to start')
  p.add_argument('--devices_per_process', type=int, default=1,
                 help='CPU devices per controller')
  p.add_argument('--timeout', type=float, default=None,
                 help='seconds for the whole run; on expiry every process is '
                 'stopped and the exit status is 124')
  p.add_argument('--grace_period', type=float,
                 default=_policy.DEFAULT_GRACE_PERIOD_S,
                 help='seconds the others get after the first failure')
  p.add_argument('--max_restarts', type=int, default=0,
                 help='after a failure, stop all controllers at once and '
                 'start all again, up to N times (torchrun\'s '
                 '--max-restarts); each gets MULTIHOST_RESTART_COUNT=0, 1, '
                 '...; a controller that exits with status 78 (restarting '
                 'will not help) ends the run')
  p.add_argument('--compilation_cache_dir', default=None, metavar='DIR',
                 help='JAX\'s persistent compilation cache folder '
                 '(JAX_COMPILATION_CACHE_DIR) for every attempt, kept '
                 'afterwards; default: $JAX_COMPILATION_CACHE_DIR if set, '
                 'else with --max_restarts a temporary folder shared by the '
                 'attempts and removed at the end')
  p.add_argument('--log_dir', default=None, metavar='DIR',
                 help='with --max_restarts: where a failed attempt that is '
                 'restarted leaves every line of each process, in a new '
                 'folder of this run (run-<UTC time>-<random>/'
                 'attempt-K.pI.log; kept, never overwritten by another '
                 'run); default: a new multihost-launch-logs-* folder in '
                 'the temp folder')
  p.add_argument('--verbosity', type=int, default=0, metavar='N',
                 help='0: while restarts are left, tracebacks are held back '
                 'and a failure that heals is told in one block naming the '
                 'files that hold them (one that ends the run shows its '
                 'traceback); 1: stream every line live')
  p.add_argument('--host_service', action='store_true',
                 help='host the coordination service in the launcher '
                 'instead of in process 0\'s companion process (the command '
                 'must use multihost.initialize())')
  p.add_argument('--hosts', choices=[_environment.NETNS], default=None,
                 help='netns: run each controller on a simulated host of '
                 'its own (a network namespace with its own address; needs '
                 'root and `ip`), the coordinator at host 0\'s address')
  p.add_argument('--trace', default=None, metavar='PATH',
                 help='write the run\'s timeline to PATH (Chrome trace-event '
                 'JSON, for ui.perfetto.dev or chrome://tracing): every '
                 'process\'s collectives and events, failures marked; the '
                 'summary names the first divergence')
  return p


def main(argv: collections.abc.Sequence[str] | None = None, *,
         prog: str = PROG) -> int:
  """Command-line entry point: parses `argv` (default sys.argv[1:]), runs the command, returns the exit status."""
  argv = sys.argv[1:] if argv is None else list(argv)
  options, command = split_command(argv)
  p = parser(prog)
  args = p.parse_args(options)
  if not command:
    p.error('give the command after --, e.g. -- python bin/train.py')
  if args.num_processes < 1 or args.devices_per_process < 1:
    p.error(f'--num_processes and --devices_per_process must be at '
            f'least 1; got {args.num_processes} and '
            f'{args.devices_per_process}.')
  if (args.timeout is not None and args.timeout < 0) or args.grace_period < 0:
    p.error(f'--timeout and --grace_period must be >= 0 seconds; got '
            f'{args.timeout} and {args.grace_period}.')
  if args.max_restarts < 0:
    p.error(f'--max_restarts must be >= 0; got {args.max_restarts}.')
  if args.compilation_cache_dir:
    try:
      os.makedirs(args.compilation_cache_dir, exist_ok=True)
    except OSError as e:
      p.error(f'--compilation_cache_dir={args.compilation_cache_dir} cannot '
              f'be created: {e.strerror}. Give a folder you can write, or '
              'leave the flag out.')
  if args.hosts is not None:
    try:
      _environment.check_hosts(args.hosts, host_service=args.host_service)
    except (ValueError, RuntimeError) as e:
      p.error(str(e))
  return run_cli(command, num_processes=args.num_processes,
                 devices_per_process=args.devices_per_process,
                 timeout=args.timeout, grace_period=args.grace_period,
                 host_service=args.host_service, hosts=args.hosts,
                 max_restarts=args.max_restarts, trace=args.trace,
                 compilation_cache_dir=args.compilation_cache_dir,
                 log_dir=args.log_dir, hold_tracebacks=args.verbosity < 1)


def run_cli(command: list[str], *, num_processes: int,
            devices_per_process: int, timeout: float | None,
            grace_period: float, host_service: bool = False,
            hosts: str | None = None, max_restarts: int = 0,
            trace: str | None = None,
            compilation_cache_dir: str | None = None,
            log_dir: str | None = None, hold_tracebacks: bool = True) -> int:
  """Runs the command with live prefixed output and a summary on stderr; returns the exit status."""
  try:
    result = _run.launch(
        command, num_processes=num_processes,
        devices_per_process=devices_per_process, timeout=timeout,
        grace_period=grace_period, stream=sys.stdout,
        summary_stream=sys.stderr, forward_signals=True,
        host_service=host_service, hosts=hosts, max_restarts=max_restarts,
        trace=trace, compilation_cache_dir=compilation_cache_dir,
        log_dir=log_dir, hold_tracebacks=hold_tracebacks)
  except OSError as e:  # The command itself could not start (as a shell).
    sys.stderr.write(
        f'multihost.launch: cannot run {command[0]!r}: {e.strerror}. Check '
        'the command after --; give a path or a program on $PATH.\n')
    return 127 if isinstance(e, FileNotFoundError) else 126
  return result.exit_code
