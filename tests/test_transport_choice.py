"""The transport rule (`_data_plane.choose_transport`) and the real CPU path."""

from __future__ import annotations

import pytest

from multihost import launch
from multihost._src.transport import plane
from tests._helpers import program

BIG = plane.DEVICE_BYTES + 1


@pytest.mark.parametrize('backend', ['gpu', 'cuda', 'rocm', 'tpu', 'TPU'])
def test_large_payloads_on_gpu_and_tpu_use_device_collectives(backend):
  assert plane.choose_transport(backend, BIG) == 'device'
  assert plane.choose_transport(backend, 64 << 20) == 'device'


@pytest.mark.parametrize('backend', ['gpu', 'tpu'])
def test_small_payloads_on_gpu_and_tpu_use_tcp(backend):
  for n in (0, 8, plane.DEVICE_BYTES):
    assert plane.choose_transport(backend, n) == 'tcp'


def test_every_payload_on_cpu_uses_tcp():
  for n in (0, 8, BIG, 1 << 30):
    assert plane.choose_transport('cpu', n) == 'tcp'


def test_the_override_wins_on_every_backend():
  for backend in ('cpu', 'gpu', 'tpu'):
    for n in (8, BIG):
      assert plane.choose_transport(backend, n,
                                          override='device') == 'device'
      assert plane.choose_transport(backend, n,
                                          override='tcp') == 'tcp'


def test_the_environment_variable_is_read_and_checked(monkeypatch):
  monkeypatch.delenv('MULTIHOST_TRANSPORT', raising=False)
  assert plane.transport(BIG) == 'tcp'  # This machine's CPU backend.
  monkeypatch.setenv('MULTIHOST_TRANSPORT', 'device')
  assert plane.transport(8) == 'device'
  assert not plane.tcp_enabled()
  monkeypatch.setenv('MULTIHOST_TRANSPORT', 'TCP')
  assert plane.transport(BIG) == 'tcp'
  monkeypatch.setenv('MULTIHOST_TRANSPORT', 'nccl')
  with pytest.raises(ValueError, match='MULTIHOST_TRANSPORT.*nccl'):
    plane.transport(8)


def test_on_cpu_small_and_large_payloads_travel_over_tcp():
  result = launch.launch(program('transport_choice'), num_processes=2,
                         devices_per_process=1, timeout=60)
  assert result.ok, result.summary + '\n' + result.outputs[0][-3000:]
  for out in result.outputs:
    for n in (8, 2 << 20):
      assert f"broadcast {n}: tcp tcp=['broadcast'] ok=True" in out, out
      assert f"allgather {n}: tcp tcp=['allgather'] ok=True" in out, out
    assert 'tree ok=True' in out, out
