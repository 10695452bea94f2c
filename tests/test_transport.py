"""Both data planes for large payloads, at an odd process count."""

from __future__ import annotations

import socket

from _helpers import program
import pytest

from multihost import env as env_lib
from multihost import launch


@pytest.mark.parametrize('transport', ['tcp', 'device'])
def test_large_payloads_over_each_transport(transport):
  result = launch.launch(program('bulk_transfers'), num_processes=3,
                         devices_per_process=1, timeout=120,
                         env={env_lib.TRANSPORT: transport})
  assert result.ok, result.summary + '\n'.join(result.outputs)
  assert all('TRANSPORT OK' in out for out in result.outputs)


def test_unknown_transport_is_a_clear_error(monkeypatch):
  from multihost import lowlevel
  monkeypatch.setenv(env_lib.TRANSPORT, 'carrier-pigeon')
  with pytest.raises(ValueError, match='use tcp'):
    lowlevel.tcp_transport_enabled()


@pytest.mark.multihost(num_processes=2, devices_per_process=1, timeout=120)
def test_a_blocked_data_plane_port_says_how_to_get_through():
  # Process 1's data-plane port refuses connections, as behind a firewall
  # that lets only the coordinator's port through.
  import time

  import jax
  import numpy as np

  import multihost
  from multihost import _tcp_link
  me = jax.process_index()
  plane = _tcp_link.get_plane('test', time.monotonic() + 30)
  if me == 1:
    plane.listener.shutdown(socket.SHUT_RDWR)  # wakes its accept(); refuses
    plane.listener.close()
  multihost.sync_global_devices('data-plane-port-closed')
  with pytest.raises(multihost.MultihostError) as e:
    multihost.broadcast_one_to_all(np.ones(1 << 18, np.float32), timeout=5)
  message = str(e.value)
  assert 'MULTIHOST_TRANSPORT=device' in message, message
  if me == 0:  # the connecting side: refused, and it says by whom
    host, port = _published_address(1)
    assert f'process 1 at {host}:{port}' in message, message
    assert 'ConnectionRefusedError' in message, message
  else:  # the listening side: nobody came
    assert isinstance(e.value, multihost.CollectiveTimeoutError), message
    assert 'process 0' in message, message


def _published_address(process: int) -> tuple[str, str]:
  from multihost import _tcp_link
  from multihost import lowlevel
  value = lowlevel.key_value_get(_tcp_link.ADDRESS_KEY.format(process), 5)
  host, port = value.decode().split('|')[:2]  # then its MAC
  return host, port
