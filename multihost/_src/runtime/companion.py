"""Runtime: the coordination service in a companion process of process 0 (the default), so that a crash of process 0's trainer is an ordinary failure.

When process 0 hosts JAX's coordination service (JAX's default), its death
takes the service down and JAX's client aborts every other process (SIGABRT,
no Python code runs). So `multihost.initialize()` on process 0 (with
failure detection on, more than one process, and no launcher hosting the
service) hosts the service in a companion process instead, bound where
process 0's would be, and every process (process 0 too) connects to it
without a service of its own. A crashed trainer on process 0 then is a peer
like any other: the others' watchdogs name process 0 and they raise
`ProcessFailureError` (or leave with the peer-loss exit status).
$MULTIHOST_COMPANION_SERVICE=0 turns this off (process 0 hosts the service,
as in plain JAX).

The companion is a `fork()` of process 0, made before JAX starts its
backends (no JAX threads exist then), so it costs milliseconds and imports
nothing. In the child only this module's code runs: stdin, stdout and
stderr go to /dev/null and every other inherited descriptor is closed (no
pipe of a launcher or file of the program stays open), SIGINT and SIGTERM
are ignored (a preemption notice to the process group must not take the
service away from trainers still saving), and it leaves with `os._exit`
(the program's exit handlers never run twice). When process 0 already runs
other Python threads (a fork is unsafe then), it starts `python -m
multihost._src.runtime.companion` instead, which imports JAX (seconds).

The companion exits:
* at once, when process 0 leaves normally (its exit handler, after the
  others have left, writes `done` to the companion's pipe): the service's
  graceful shutdown, given at most `_SHUTDOWN_BOUND_S` (5 s);
* when process 0 died or left without saying done (its end of the pipe
  closes): as soon as no controller is connected any more (the others saw
  the failure and left), at the latest `heartbeat_timeout +
  _CRASH_GRACE_S` (10 s) later, however the others fare (a peer cut off or
  SIGSTOPped stays connected): without the service's graceful shutdown,
  which would wait for every task at its shutdown barrier up to the
  shutdown timeout;
* on SIGKILL (e.g. with process 0's process group).
Either way it never waits on the service: it leaves with `os._exit`.

What remains fatal: the loss of host 0 itself (the machine, or its network
link), which takes the companion with it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

from multihost import env as _env
from multihost._src.runtime import coordination
from multihost._src.runtime import settings

_READY = b'multihost-companion-ready'
_DONE = b'done\n'
_START_TIMEOUT_S = 60.0
# After process 0 died: how long, beyond the heartbeat timeout (within which
# the others' watchdogs learn of its death), the service still serves them.
_CRASH_GRACE_S = 10.0
# Process 0 left normally: the service's graceful shutdown gets this long.
_SHUTDOWN_BOUND_S = 5.0
_EXIT_WAIT_S = 10.0
_POLL_S = 0.2
# absl's C++ threshold that shows errors only (2: ERROR).
_CPP_ERRORS_ONLY = 2


class Companion:
  """Process 0's companion process, which hosts the coordination service.

  Args:
    pid: the companion's process id (a child of this process).
    done_fd: this process's end of the pipe the companion reads.
    popen: the `subprocess.Popen` when it was started as a program.
    forked: whether it is a fork of this process.
  """

  def __init__(self, pid: int, done_fd: int, *,
               popen: subprocess.Popen[bytes] | None = None,
               forked: bool = False):
    self.pid = pid
    self.forked = forked
    self._done_fd: int | None = done_fd
    self._popen = popen
    self._exited = False

  def alive(self) -> bool:
    """True while the companion hosts the service."""
    if self._done_fd is None or self._exited:
      return False
    return self._poll() is None

  def _poll(self) -> int | None:
    if self._popen is not None:
      return self._popen.poll()
    try:
      pid, status = os.waitpid(self.pid, os.WNOHANG)
    except ChildProcessError:  # Reaped elsewhere.
      self._exited = True
      return -1
    if pid == 0:
      return None
    self._exited = True
    return os.waitstatus_to_exitcode(status)

  def _wait(self, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while self._poll() is None:
      if time.monotonic() > deadline:
        return False
      time.sleep(0.01)
    return True

  def release(self) -> None:
    """Process 0 leaves at once after an error: the service ends now, without its graceful shutdown.

    The others are then aborted by JAX's client, as when process 0 hosts
    the service itself and leaves with `os._exit`; a process sleeping
    outside any collective would otherwise keep the service up.
    """
    fd, self._done_fd = self._done_fd, None
    if fd is not None:
      with contextlib.suppress(ProcessLookupError):
        os.kill(self.pid, signal.SIGKILL)
      os.close(fd)

  def finish(self) -> None:
    """Process 0 leaves normally: disconnects, then lets the companion stop the service.

    The runtime's exit sequence runs it after the watchdog's exit handshake,
    so once the others have left.
    """
    fd, self._done_fd = self._done_fd, None
    if fd is None:
      return
    try:
      import jax  # pylint: disable=g-import-not-at-top
      if jax.distributed.is_initialized():
        jax.distributed.shutdown()
    finally:
      try:
        os.write(fd, _DONE)
      except OSError:
        pass
      os.close(fd)
      if not self._wait(_EXIT_WAIT_S):
        with contextlib.suppress(ProcessLookupError):
          os.kill(self.pid, signal.SIGKILL)
        self._wait(_EXIT_WAIT_S)


def enabled() -> bool:
  """Whether process 0 hosts the service in a companion: yes unless $MULTIHOST_COMPANION_SERVICE is false."""
  return settings.companion_service()


def _fork_is_safe() -> bool:
  """No other Python thread runs and JAX has started no backend (no JAX threads)."""
  return (hasattr(os, 'fork') and threading.active_count() == 1 and
          not coordination.backends_started())


def start(bind_address: str, num_processes: int, *, heartbeat_timeout: int,
          shutdown_timeout: int) -> Companion:
  """Starts the companion hosting the service at `bind_address`; returns once it listens.

  Raises:
    RuntimeError: it did not start within `_START_TIMEOUT_S` (its output is
      in the message).
  """
  args = [bind_address, str(num_processes), str(heartbeat_timeout),
          str(shutdown_timeout)]
  if _fork_is_safe():
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # The companion: never returns.
      _forked_child(ready_w, done_r, args)
    os.close(ready_w)
    os.close(done_r)
    companion = Companion(pid, done_w, forked=True)
    how = f'fork of process 0 (pid {pid})'
  else:
    argv = [sys.executable, '-m', 'multihost._src.runtime.companion', *args]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdin is not None and proc.stdout is not None
    ready_r = os.dup(proc.stdout.fileno())
    proc.stdout.close()
    companion = Companion(proc.pid, os.dup(proc.stdin.fileno()), popen=proc)
    proc.stdin.close()
    how = f'`{" ".join(argv)}`'
  try:
    _await_ready(ready_r, how)
  except BaseException:
    with contextlib.suppress(ProcessLookupError):
      os.kill(companion.pid, signal.SIGKILL)
    companion._wait(_EXIT_WAIT_S)  # pylint: disable=protected-access
    raise
  finally:
    os.close(ready_r)
  return companion


def _await_ready(fd: int, how: str) -> None:
  deadline = time.monotonic() + _START_TIMEOUT_S
  seen = b''
  while _READY not in seen:
    left = deadline - time.monotonic()
    ready, _, _ = select.select([fd], [], [], max(left, 0))
    chunk = os.read(fd, 4096) if ready else b''
    if not chunk:
      raise RuntimeError(
          f'[process=0] multihost: the coordination-service companion '
          f'({how}) did not start within {_START_TIMEOUT_S:g} s; its output: '
          f'{seen.decode(errors="replace")[-2000:]!r}. Set '
          f'{_env.COMPANION_SERVICE}=0 to host the service in process 0.')
    seen += chunk


def _forked_child(ready_w: int, done_r: int, args: list[str]) -> None:
  """The forked companion: hosts the service, then `os._exit` (no exit handlers)."""
  code = 1
  try:
    for sig in (signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
      os.dup2(null, fd)
    keep = {0, 1, 2, ready_w, done_r}
    for fd in _open_fds():
      if fd not in keep:
        with contextlib.suppress(OSError):
          os.close(fd)
    code = _host(args, ready_w, done_r)
  except BaseException:  # pylint: disable=broad-except
    with contextlib.suppress(OSError):
      os.write(ready_w, traceback.format_exc().encode())
  finally:
    os._exit(code)  # pylint: disable=protected-access


def _open_fds() -> list[int]:
  try:
    return [int(fd) for fd in os.listdir('/proc/self/fd')]
  except OSError:
    return list(range(3, 1024))


def _host(args: list[str], ready_fd: int, done_fd: int) -> int:
  """Hosts the service until process 0 says done or is gone (see the module docstring)."""
  p = argparse.ArgumentParser(prog='python -m multihost._src.runtime.companion')
  p.add_argument('bind_address')
  p.add_argument('num_processes', type=int)
  p.add_argument('heartbeat_timeout', type=int)
  p.add_argument('shutdown_timeout', type=int)
  a = p.parse_args(args)
  with cpp_advice_hidden():
    service = coordination.start_service(
        a.bind_address, a.num_processes, heartbeat_timeout=a.heartbeat_timeout,
        shutdown_timeout=a.shutdown_timeout)
  os.write(ready_fd, _READY + b'\n')
  os.close(ready_fd)
  said = b''
  while True:  # Until process 0 says done, or its end of the pipe closes.
    chunk = os.read(done_fd, 64)
    if not chunk:
      break
    said += chunk
    if _DONE in said:
      break
  if _DONE not in said:  # Process 0 died: serve the others until they left.
    deadline = time.monotonic() + a.heartbeat_timeout + _CRASH_GRACE_S
    idle = 0
    while time.monotonic() < deadline and idle < 2:
      connected = _connections()
      idle = idle + 1 if connected == 0 else 0
      time.sleep(_POLL_S)
    # No graceful shutdown: it waits for every task at the service's
    # shutdown barrier, up to shutdown_timeout (300 s by default), and a
    # task cut off or stopped never comes.
    os._exit(0)  # pylint: disable=protected-access
  # Process 0 left normally, the others before it: the graceful shutdown,
  # but bounded (a task that is gone without saying so never comes to its
  # barrier either).
  threading.Thread(target=service.shutdown, daemon=True,
                   name='multihost-companion-shutdown').start()
  _exit_within(_SHUTDOWN_BOUND_S)
  return 0


def _exit_within(seconds: float) -> None:
  """Leaves with `os._exit(0)` once the service's shutdown thread is done, or after `seconds` (never waits on it longer)."""
  deadline = time.monotonic() + seconds
  for thread in threading.enumerate():
    if thread.name == 'multihost-companion-shutdown':
      thread.join(max(0.0, deadline - time.monotonic()))
  os._exit(0)  # pylint: disable=protected-access


def _connections() -> int | None:
  """Established TCP connections of this process (the service's clients); None if unknown."""
  try:
    inodes = set()
    for fd in os.listdir('/proc/self/fd'):
      with contextlib.suppress(OSError):
        link = os.readlink(f'/proc/self/fd/{fd}')
        if link.startswith('socket:['):
          inodes.add(link[8:-1])
    count = 0
    for table in ('/proc/net/tcp', '/proc/net/tcp6'):
      with contextlib.suppress(FileNotFoundError), open(table) as f:
        for line in f.readlines()[1:]:
          fields = line.split()
          if len(fields) > 9 and fields[3] == '01' and fields[9] in inodes:
            count += 1
    return count
  except OSError:
    return None


@contextlib.contextmanager
def cpp_advice_hidden():
  """JAX's C++ logs show errors only inside the block (starting the service).

  With recoverability on, starting the coordination service logs the C++
  advice "... should invoke `WaitAtBarrier` explicitly at the end of the
  program", which `multihost` does for the program at exit. Outside the
  block the threshold is $TF_CPP_MIN_LOG_LEVEL again (JAX's default, 1).
  With TF_CPP_MIN_LOG_LEVEL=0 nothing is hidden.
  """
  try:
    level = int(os.environ.get(_env.CPP_LOG_LEVEL, '1'))
  except ValueError:
    level = 1
  if level == 0 or level >= _CPP_ERRORS_ONLY:
    yield
    return
  hidden = _set_cpp_level(_CPP_ERRORS_ONLY)
  try:
    yield
  finally:
    if hidden:
      _set_cpp_level(level)


def _set_cpp_level(level: int) -> bool:
  try:
    from jaxlib import utils  # pylint: disable=g-import-not-at-top
    utils.absl_set_min_log_level(level)
  except (ImportError, AttributeError):  # Another jaxlib: the line shows.
    return False
  return True


def await_service(address: str, timeout: float) -> bool:
  """Waits until something listens at `address` ('host:port'); False after `timeout` s.

  For the processes other than 0: JAX's client that connects before the
  service listens retries only about a second later, so each waits here,
  probing every few milliseconds, and connects once the service is up.
  """
  host, _, port = address.rpartition(':')
  deadline = time.monotonic() + timeout
  while True:
    try:
      with socket.create_connection((host.strip('[]'), int(port)),
                                    timeout=1.0):
        return True
    except (OSError, ValueError):
      if time.monotonic() > deadline:
        return False
      time.sleep(0.005)


def start_for_job(kwargs: dict, environ) -> Companion | None:
  """For `initialize(**kwargs)`: on process 0 of a job of 2 or more, starts the companion (returned); else None.

  `kwargs` are those of `jax.distributed.initialize`, the job's
  coordinator, process count and index in them (`clusters.chain` found
  them). The companion binds where process 0's own service would: the
  `coordinator_bind_address`, else $JAX_COORDINATOR_BIND_ADDRESS, else the
  coordinator address itself (never every interface, JAX's default).
  """
  address, count, index = (kwargs.get('coordinator_address'),
                           kwargs.get('num_processes'),
                           kwargs.get('process_id'))
  if address is None or count is None or index != 0 or count < 2:
    return None
  bind = (kwargs.get('coordinator_bind_address') or
          environ.get(_env.COORDINATOR_BIND) or address)
  return start(
      bind, count,
      heartbeat_timeout=int(kwargs.get('heartbeat_timeout_seconds', 100)),
      shutdown_timeout=int(kwargs.get('shutdown_timeout_seconds', 300)))


def main(argv: list[str] | None = None) -> int:
  """The companion as a program: stdin is process 0's pipe, stdout says when it listens."""
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
  ready = os.dup(sys.stdout.fileno())
  null = os.open(os.devnull, os.O_WRONLY)
  os.dup2(null, sys.stdout.fileno())
  os.dup2(null, sys.stderr.fileno())
  return _host(sys.argv[1:] if argv is None else argv, ready,
               sys.stdin.fileno())


if __name__ == '__main__':
  sys.exit(main())
