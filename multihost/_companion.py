"""Runtime: the coordination service in a companion process of process 0, so that a crash of process 0's trainer is an ordinary failure.

When process 0 hosts JAX's coordination service (JAX's default), its death
takes the service down and JAX's client aborts every other process (SIGABRT,
no Python code runs). With $MULTIHOST_COMPANION_SERVICE=1,
`multihost.initialize()` on process 0 instead starts `python -m
multihost._companion`, a child process that hosts the service (bound where
process 0's would be), and every process (process 0 too) connects to it
without a service of its own. A crashed trainer on process 0 then is a peer
like any other: the others' watchdogs name process 0 and they raise
`ProcessFailureError`.

The companion exits:
* at once, when process 0 leaves normally (its exit handler, after the
  others have left, writes `done` to the companion's stdin);
* `heartbeat_timeout + _CRASH_GRACE_S` seconds after process 0 died without
  leaving (its stdin reaches end of file), time for the others to see the
  failure, raise and leave;
* on SIGKILL. It ignores SIGINT and SIGTERM (a preemption notice to the
  process group must not take the service away from trainers still saving).

What remains fatal: the loss of host 0 itself (the machine, or its network
link), which takes the companion with it.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time

from multihost import _coordination
from multihost import env as _env

_READY = b'multihost-companion-ready'
_DONE = b'done\n'
_START_TIMEOUT_S = 60.0
_CRASH_GRACE_S = 20.0
_EXIT_WAIT_S = 10.0

class Companion:
  """Process 0's companion process, which hosts the coordination service."""

  def __init__(self, proc: subprocess.Popen[bytes]):
    self.proc: subprocess.Popen[bytes] | None = proc

  def alive(self) -> bool:
    """True while the companion hosts the service."""
    return self.proc is not None and self.proc.poll() is None

  def finish(self) -> None:
    """Process 0 leaves normally: disconnects, then lets the companion stop the service.

    The runtime's exit sequence runs it after the watchdog's exit handshake,
    so once the others have left.
    """
    proc, self.proc = self.proc, None
    if proc is None:
      return
    try:
      import jax  # pylint: disable=g-import-not-at-top
      if jax.distributed.is_initialized():
        jax.distributed.shutdown()
    finally:
      try:
        proc.stdin.write(_DONE)
        proc.stdin.close()
      except OSError:
        pass
      try:
        proc.wait(_EXIT_WAIT_S)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(_EXIT_WAIT_S)


def start(bind_address: str, num_processes: int, *, heartbeat_timeout: int,
          shutdown_timeout: int) -> Companion:
  """Starts the companion hosting the service at `bind_address`; returns once it listens.

  Raises:
    RuntimeError: it did not start within `_START_TIMEOUT_S` (its output is
      in the message).
  """
  argv = [sys.executable, '-m', 'multihost._companion', bind_address,
          str(num_processes), str(heartbeat_timeout), str(shutdown_timeout)]
  proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
  assert proc.stdout is not None
  deadline = time.monotonic() + _START_TIMEOUT_S
  seen = b''
  while _READY not in seen:
    left = deadline - time.monotonic()
    ready, _, _ = select.select([proc.stdout], [], [], max(left, 0))
    chunk = os.read(proc.stdout.fileno(), 4096) if ready else b''
    if not chunk:
      proc.kill()
      proc.wait(10)
      raise RuntimeError(
          f'[process=0] multihost: the coordination-service companion '
          f'(`{" ".join(argv)}`) did not start within {_START_TIMEOUT_S:g} s '
          f'(exit {proc.returncode}); its output: '
          f'{seen.decode(errors="replace")[-2000:]!r}. Unset '
          f'{_env.COMPANION_SERVICE} to host the service in process 0.')
    seen += chunk
  proc.stdout.close()
  return Companion(proc)


def start_for_job(kwargs: dict, environ) -> Companion | None:
  """For `initialize(**kwargs)`: resolves the cluster's parameters into `kwargs`; on process 0, starts the companion (returned).

  `kwargs` are those of `jax.distributed.initialize`; afterwards they name
  the coordinator, the process count and this process's index explicitly.
  The companion binds where process 0's own service would: the
  `coordinator_bind_address`, else $JAX_COORDINATOR_BIND_ADDRESS, else the
  coordinator address itself (never every interface, JAX's default).
  """
  address, count, index = _coordination.detect_cluster(
      kwargs.get('coordinator_address'), kwargs.get('num_processes'),
      kwargs.get('process_id'), kwargs.get('cluster_detection_method'))
  if None in (address, count, index):
    raise ValueError(
        f'{_env.COMPANION_SERVICE}=1 needs the coordinator address, the '
        f'process count and this process index; found {address!r}, '
        f'{count!r}, {index!r}. Pass them to multihost.initialize() or run '
        'under a cluster JAX detects.')
  kwargs.update(coordinator_address=address, num_processes=count,
                process_id=index)
  if index != 0:
    return None
  bind = (kwargs.get('coordinator_bind_address') or
          environ.get(_env.COORDINATOR_BIND) or address)
  return start(
      bind, count,
      heartbeat_timeout=int(kwargs.get('heartbeat_timeout_seconds', 100)),
      shutdown_timeout=int(kwargs.get('shutdown_timeout_seconds', 300)))


def main(argv: list[str] | None = None) -> int:
  """The companion: hosts the service until process 0 says done or is gone (+ grace)."""
  p = argparse.ArgumentParser(prog='python -m multihost._companion')
  p.add_argument('bind_address')
  p.add_argument('num_processes', type=int)
  p.add_argument('heartbeat_timeout', type=int)
  p.add_argument('shutdown_timeout', type=int)
  args = p.parse_args(argv)
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
  service = _coordination.start_service(
      args.bind_address, args.num_processes,
      heartbeat_timeout=args.heartbeat_timeout,
      shutdown_timeout=args.shutdown_timeout)
  os.write(sys.stdout.fileno(), _READY + b'\n')
  os.close(sys.stdout.fileno())
  said = b''
  while True:  # Until process 0 says done, or its end of the pipe closes.
    chunk = os.read(sys.stdin.fileno(), 64)
    if not chunk:
      break
    said += chunk
    if _DONE in said:
      break
  if _DONE not in said:  # Process 0 died: give the others time to see it.
    time.sleep(args.heartbeat_timeout + _CRASH_GRACE_S)
  service.shutdown()
  return 0


if __name__ == '__main__':
  sys.exit(main())
