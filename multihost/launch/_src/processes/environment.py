"""What each controller is started with: a free coordinator port, its environment, where it runs (`--hosts`), a label in `ps`."""

from __future__ import annotations

import collections.abc
import os
import re
import socket
import tempfile

from multihost import env as env_lib

NETNS = 'netns'
HOSTS_KINDS = (None, NETNS)

# A Python interpreter's file name: python, python3, python3.11 ...
_PYTHON = re.compile(r'python[0-9.]*$')


def find_free_port(host: str = '127.0.0.1') -> int:
  """A TCP port on `host` that was free a moment ago (binds port 0).

  Nothing keeps it free: where the port is used seconds later (a
  controller's coordination service, after JAX's import), prefer
  `hold_free_port`.
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def hold_free_port(host: str = '127.0.0.1') -> socket.socket:
  """A socket bound to a free TCP port on `host` that keeps the port from every other program's port-0 bind while it stays open, yet lets the coordination service bind it.

  Why: a port only found free stays free until the service binds it,
  seconds later; another launch on this machine may be given the same
  port meanwhile. JAX's service (gRPC) binds with SO_REUSEPORT, so both
  services would then listen on it and the kernel would share the
  connections between them: a task registering at the other job's
  service aborts both jobs (seen in this project's tests). This socket
  is bound with SO_REUSEPORT too (so the service's bind succeeds) and
  never listens (so it is given no connection). The port is
  `hold.getsockname()[1]`; close the socket when the run is over.
  """
  s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  try:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host, 0))
  except BaseException:
    s.close()
    raise
  return s


def child_env(process_id: int, *, num_processes: int, devices_per_process: int,
              port: int, base: collections.abc.Mapping[str, str] | None = None,
              host: str = '127.0.0.1') -> dict[str, str]:
  """The environment of controller `process_id` of a local run (see `multihost.env.controller_env`)."""
  return env_lib.controller_env(process_id, num_processes=num_processes,
                                devices_per_process=devices_per_process,
                                port=port, base=base, host=host)


def check_command(command: collections.abc.Sequence[str], *,
                  num_processes: int, devices_per_process: int) -> None:
  """Raises ValueError, saying what to pass, for a command or process count a run cannot have."""
  if isinstance(command, str) or not command:
    raise ValueError(
        f'command must be a non-empty list of arguments, e.g. '
        f"['python', 'train.py']; got {command!r}.")
  if num_processes < 1 or devices_per_process < 1:
    raise ValueError(
        'num_processes and devices_per_process must be at least 1; got '
        f'num_processes={num_processes}, '
        f'devices_per_process={devices_per_process}.')


def compilation_cache_dir(
    choice: str | None, *, extra_env: collections.abc.Mapping[str, str],
    max_restarts: int) -> tuple[str | None, str | None]:
  """The compilation cache folder every attempt gets, and the same again if it was made here (to remove at the end), else None.

  `choice` (the caller's folder), made if missing; else None when
  `JAX_COMPILATION_CACHE_DIR` is in `extra_env` or this process's
  environment (the controllers inherit it); else, with restarts, a fresh
  folder under the temp folder; else None.
  """
  if choice is not None:
    os.makedirs(choice, exist_ok=True)
    return choice, None
  if (env_lib.COMPILATION_CACHE_DIR in extra_env or
      env_lib.COMPILATION_CACHE_DIR in os.environ):
    return None, None
  if max_restarts > 0:
    made = tempfile.mkdtemp(prefix='multihost-jax-cache-')
    return made, made
  return None, None


def check_hosts(hosts: str | None, *, host_service: bool) -> None:
  """Raises if `hosts` is unknown, or 'netns' cannot work here (with the reason)."""
  if hosts not in HOSTS_KINDS:
    raise ValueError(f"hosts must be None or {NETNS!r}; got {hosts!r}.")
  if hosts is None:
    return
  if host_service:
    raise ValueError(
        "host_service=True cannot be combined with hosts='netns': the "
        'launcher is not on any simulated host; drop one of them.')
  from multihost import netns as hosts_lib  # pylint: disable=g-import-not-at-top
  ok, why = hosts_lib.available()
  if not ok:
    raise hosts_lib.HostsError(f"hosts='netns' cannot work here: {why}")


def labelled(command: collections.abc.Sequence[str],
             index: int) -> list[str]:
  """`command`, with `-X multihost_process=<index>` after the interpreter when it runs Python.

  So that `ps -o pid,args` (and `pgrep -f multihost_process=1`) tells the
  controllers apart. A process's name (`comm`) cannot carry the index: exec
  resets it to the program's file name, and only the process itself can
  change it afterwards; argv[0] cannot either, since Python finds its
  virtual environment from it. CPython keeps unknown `-X` options in
  `sys._xoptions` and otherwise ignores them; other programs run unchanged.
  """
  command = list(command)
  if command and _PYTHON.match(os.path.basename(command[0])):
    return [command[0], '-X', f'multihost_process={index}', *command[1:]]
  return command
