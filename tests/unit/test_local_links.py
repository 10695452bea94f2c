"""Links between processes on one host: a local (Unix domain) socket, TCP otherwise.

Two planes of one job (in-memory coordination, real sockets): they link over
the local socket; with $MULTIHOST_LOCAL_LINKS=0, or when the published local
name does not answer here (as for a process on another host or network
namespace), over TCP. Frames move on either.
"""

from __future__ import annotations

import socket
import time

import fake_coordination as fake
import pytest

from multihost import env as env_lib
from multihost._src.auth import secret as _secret
from multihost._src.transport.tcp import auth
from multihost._src.transport.tcp import link as _tcp_link

SECRET = 'cd' * 32


@pytest.fixture
def job(monkeypatch):
  """Two runtimes of one job with a configured secret; their planes are made by the test."""
  monkeypatch.setattr(_secret, '_TAKEN', {})
  monkeypatch.setenv(env_lib.JOB_SECRET, SECRET)
  _, rts = fake.runtimes(2)
  planes = []
  fake.run(rts, lambda rt: _secret.job_keys(timeout=5, runtime=rt))
  yield rts, planes
  for p in planes:
    _tcp_link.close_plane(p)
  fake.stop(rts)
  monkeypatch.setattr(_secret, '_TAKEN', {})


def _linked(rts, planes) -> list[socket.AddressFamily]:
  """Opens the link 0 <-> 1, moves one frame down it; each end's socket family."""

  def transfer(rt):
    link = planes[rt.index].conn(1 - rt.index, time.monotonic() + 10, 'test')
    link.sock.settimeout(5)
    if rt.index == 0:
      link.sock.sendall(link.frame(7, 0))
    else:
      link.read_frame(7, 0, 'test', 0)
    return link.sock.family

  out = [got for got, _ in fake.run(rts, transfer)]
  assert all(isinstance(got, socket.AddressFamily) for got in out), out
  return out


def test_processes_on_one_host_link_over_a_local_socket(job):
  rts, planes = job
  planes += [_tcp_link.Plane(rt, 5.0, 'test') for rt in rts]
  assert all(p.local for p in planes)
  assert _linked(rts, planes) == [socket.AF_UNIX] * 2


def test_a_local_link_takes_a_1_mib_frame_without_its_peer_reading(job):
  """A broadcast's source sends what the socket takes ahead of its agreement (`tcp.eager.Eager`): on a local link, a whole 1 MiB frame."""
  rts, planes = job
  planes += [_tcp_link.Plane(rt, 5.0, 'test') for rt in rts]
  assert _linked(rts, planes) == [socket.AF_UNIX] * 2
  link = planes[0].conn(1, time.monotonic() + 5, 'test')
  view = memoryview(bytes(1 << 20))
  sent = 0
  link.sock.setblocking(False)
  try:
    while sent < len(view):
      sent += link.sock.send(view[sent:])
  except BlockingIOError:
    pass
  finally:
    link.sock.settimeout(5)
  assert sent == len(view)


def test_with_local_links_off_the_link_is_tcp(job, monkeypatch):
  monkeypatch.setenv(env_lib.LOCAL_LINKS, '0')
  rts, planes = job
  planes += [_tcp_link.Plane(rt, 5.0, 'test') for rt in rts]
  assert not any(p.local for p in planes)
  assert _linked(rts, planes) == [socket.AF_INET] * 2


def test_a_local_name_that_does_not_answer_here_falls_back_to_tcp(job):
  rts, planes = job
  planes += [_tcp_link.Plane(rt, 5.0, 'test') for rt in rts]
  # Process 1's record names a local socket of another host (or network
  # namespace): nothing listens on it here.
  host = planes[1].listener.getsockname()[0]
  port = planes[1].listener.getsockname()[1]
  rts[1].client.kv_set(auth.ADDRESS_KEY.format(1), auth.address_record(
      planes[1].secret, 1, host, port, 'multihost-' + '0' * 32))
  start = time.monotonic()
  assert _linked(rts, planes) == [socket.AF_INET] * 2
  assert time.monotonic() - start < 2  # refused at once, not timed out
