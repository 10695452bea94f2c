"""The `Transport` interface and the rule that picks one per payload (`choice.choose_transport`)."""

from __future__ import annotations

import inspect

import pytest

from multihost._src.transport import choice
from multihost._src.transport import device
from multihost._src.transport import interface
from multihost._src.transport.tcp import chain

BIG = choice.DEVICE_BYTES + 1


@pytest.mark.parametrize('backend', ['gpu', 'cuda', 'rocm', 'tpu', 'TPU'])
def test_large_payloads_on_gpu_and_tpu_use_device_collectives(backend):
  assert choice.choose_transport(backend, BIG) == 'device'
  assert choice.choose_transport(backend, 64 << 20) == 'device'


@pytest.mark.parametrize('backend', ['gpu', 'tpu'])
def test_small_payloads_on_gpu_and_tpu_use_tcp(backend):
  for n in (0, 8, choice.DEVICE_BYTES):
    assert choice.choose_transport(backend, n) == 'tcp'


def test_every_payload_on_cpu_uses_tcp():
  for n in (0, 8, BIG, 1 << 30):
    assert choice.choose_transport('cpu', n) == 'tcp'


def test_the_override_wins_on_every_backend():
  for backend in ('cpu', 'gpu', 'tpu'):
    for n in (8, BIG):
      assert choice.choose_transport(backend, n,
                                          override='device') == 'device'
      assert choice.choose_transport(backend, n,
                                          override='tcp') == 'tcp'


def test_the_environment_variable_is_read_and_checked(monkeypatch):
  monkeypatch.delenv('MULTIHOST_TRANSPORT', raising=False)
  assert choice.transport(BIG) == 'tcp'  # This machine's CPU backend.
  monkeypatch.setenv('MULTIHOST_TRANSPORT', 'device')
  assert choice.transport(8) == 'device'
  assert not choice.tcp_enabled()
  monkeypatch.setenv('MULTIHOST_TRANSPORT', 'TCP')
  assert choice.transport(BIG) == 'tcp'
  monkeypatch.setenv('MULTIHOST_TRANSPORT', ' device ')
  assert choice.transport(BIG) == 'device'
  monkeypatch.setenv('MULTIHOST_TRANSPORT', '')  # empty: as if unset
  assert choice.transport(8) == 'tcp'
  monkeypatch.setenv('MULTIHOST_TRANSPORT', 'device')
  monkeypatch.delenv('MULTIHOST_TRANSPORT')  # read anew at every call
  assert choice.transport(BIG) == 'tcp'
  monkeypatch.setenv('MULTIHOST_TRANSPORT', 'nccl')
  with pytest.raises(ValueError, match='MULTIHOST_TRANSPORT.*nccl'):
    choice.transport(8)


@pytest.mark.parametrize('impl', [chain.TCP, device.DEVICE],
                         ids=['tcp', 'device'])
def test_both_transports_implement_the_interface_with_its_signatures(impl):
  assert isinstance(impl.name, str)
  for method in ('broadcast', 'allgather'):
    theirs = inspect.signature(getattr(type(impl), method)).parameters
    ours = inspect.signature(getattr(interface.Transport, method)).parameters
    assert [(p.name, p.kind, p.default) for p in theirs.values()] == [
        (p.name, p.kind, p.default) for p in ours.values()], method


def test_choose_returns_the_named_transport(monkeypatch):
  monkeypatch.delenv('MULTIHOST_TRANSPORT', raising=False)
  assert choice.choose(BIG) is chain.TCP
  monkeypatch.setenv('MULTIHOST_TRANSPORT', 'device')
  assert choice.choose(8) is device.DEVICE
  assert choice.choose(8).name == choice.transport(8) == 'device'


