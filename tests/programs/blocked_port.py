"""Process 1's data-plane port refuses connections; a broadcast must say how to get through.

As behind a firewall that lets only the coordinator's port through. Each
process checks its own error's text and prints `BLOCKED-PORT OK`; a check
that fails raises (the process exits non-zero, with the message).
"""

from __future__ import annotations

import socket
import time

import numpy as np

import multihost
from multihost import lowlevel
from multihost._src.transport.tcp import auth
from multihost._src.transport.tcp import link


def _published_address(process: int) -> tuple[str, str]:
  value = lowlevel.key_value_get(auth.ADDRESS_KEY.format(process), 5)
  host, port = value.decode().split('|')[:2]  # then its MAC
  return host, port


def main() -> None:
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)

  me = jax.process_index()
  plane = link.get_plane('test', time.monotonic() + 30)
  if me == 1:
    address = plane.listener.getsockname()
    plane.listener.shutdown(socket.SHUT_RDWR)  # wakes its accept(); refuses
    plane.listener.close()
    # The port stays this process's, bound but not listening (connections
    # are refused), so that no other program that starts meanwhile (e.g. a
    # test beside this one) can listen on it and hold process 0's handshake.
    hold = socket.socket(plane.listener.family, socket.SOCK_STREAM)
    hold.bind(address)
  # The barrier starts process 0's link setup, whose refused connect then
  # waits up to the watchdog's bound (longer than the broadcast's timeout)
  # for process 1 to be named as failed: the broadcast's own connect must
  # not wait behind it, or it times out instead of saying it was refused.
  multihost.sync_global_devices('data-plane-port-closed')
  try:
    multihost.broadcast_one_to_all(np.ones(1 << 18, np.float32), timeout=2)
  except multihost.MultihostError as e:
    error = e
  else:
    raise AssertionError(f'process {me}: the broadcast did not raise')
  # Process 1 stays until process 0 has its error (a process that left would
  # be named as failed instead), as a test's controllers do.
  lowlevel.wait_at_barrier('broadcast-failed', 60)
  message = str(error)
  assert 'MULTIHOST_TRANSPORT=device' in message, message
  if me == 0:  # the connecting side: refused, and it says by whom
    host, port = _published_address(1)
    assert f'process 1 at {host}:{port}' in message, message
    assert 'ConnectionRefusedError' in message, message
  else:  # the listening side: nobody came
    assert isinstance(error, multihost.CollectiveTimeoutError), message
    assert 'process 0' in message, message
  print('BLOCKED-PORT OK', flush=True)


if __name__ == '__main__':
  main()
