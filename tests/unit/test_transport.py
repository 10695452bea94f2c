"""The TCP transport's settings and stripes, in one process (the real transfers are in tests/multiprocess/test_transport_processes.py)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from multihost import env as env_lib


def test_a_bad_lane_count_is_a_clear_error(monkeypatch):
  from multihost._src.runtime import settings
  for bad, match in (('0', 'positive number'), ('9', 'more than 8'),
                     ('two', 'positive number')):
    monkeypatch.setenv(env_lib.TCP_LANES, bad)
    with pytest.raises(ValueError, match=match):
      settings.tcp_lanes()
  monkeypatch.setenv(env_lib.TCP_LANES, '')
  assert settings.tcp_lanes() == 2


def test_stripes_cover_the_payload_once():
  from multihost._src.transport.tcp import payload
  assert payload.stripes(payload.STRIPE_BYTES - 1, 2) == [
      (0, payload.STRIPE_BYTES - 1)]
  assert payload.stripes(10 << 20, 1) == [(0, 10 << 20)]
  for length in (payload.STRIPE_BYTES, (5 << 20) + 3, 64 << 20):
    for lanes in range(2, 9):
      got = payload.stripes(length, lanes)
      assert 1 < len(got) <= lanes, (length, lanes, got)
      assert got[0][0] == 0 and got[-1][1] == length
      assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
      assert all(a % 4096 == 0 for a, _ in got)


def _congestion(conn) -> str:
  return conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION,
                         16).split(b'\0', 1)[0].decode()


def test_a_tcp_link_leaves_a_pacing_congestion_control_for_reno(monkeypatch):
  """A TCP link whose congestion control paces (bbr) switches to reno ($MULTIHOST_TCP_CONGESTION unset or auto); 'keep' keeps it; a name sets that one; reno under auto stays reno."""
  from multihost._src.transport.tcp import sockets
  conn, accepted, listener = _tcp_pair()
  listener.close()
  try:
    try:
      conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b'bbr')
    except OSError as e:
      pytest.skip(f'this kernel does not let this process use bbr ({e}): '
                  'there is no pacing default to leave')
    for value, want in (('keep', 'bbr'), ('', 'reno'), ('bbr', 'bbr'),
                        ('auto', 'reno'), ('reno', 'reno')):
      monkeypatch.setenv(env_lib.TCP_CONGESTION, value)
      sockets.tune(conn)
      assert _congestion(conn) == want, (value, _congestion(conn))
    monkeypatch.setenv(env_lib.TCP_CONGESTION, 'auto')  # reno stays reno
    sockets.tune(conn)
    assert _congestion(conn) == 'reno'
    conn.sendall(b'bytes')  # (the link still works)
    assert accepted.recv(5) == b'bytes'
  finally:
    conn.close()
    accepted.close()


def test_a_congestion_control_the_kernel_refuses_is_a_clear_error(
    monkeypatch):
  from multihost._src.runtime import settings
  from multihost._src.transport.tcp import sockets
  monkeypatch.setenv(env_lib.TCP_CONGESTION, 'no_such_cc')
  with pytest.raises(ValueError, match=r"MULTIHOST_TCP_CONGESTION='no_such_cc'"
                     r'.*choose one of .*reno'):
    sockets.check_congestion()
  monkeypatch.setenv(env_lib.TCP_CONGESTION, 'reno; rm')
  with pytest.raises(ValueError, match='is not a congestion control'):
    settings.tcp_congestion()
  for fine in ('', 'auto', 'keep', 'reno'):
    monkeypatch.setenv(env_lib.TCP_CONGESTION, fine)
    sockets.check_congestion()


def test_unknown_transport_is_a_clear_error(monkeypatch):
  from multihost import lowlevel
  monkeypatch.setenv(env_lib.TRANSPORT, 'carrier-pigeon')
  with pytest.raises(ValueError, match='use tcp'):
    lowlevel.tcp_transport_enabled()




class _Counting(socket.socket):
  """A socket that counts its recv_into calls (each one a wake-up)."""
  calls = 0

  def recv_into(self, *args, **kwargs):
    self.calls += 1
    return super().recv_into(*args, **kwargs)


def test_a_large_tcp_read_wakes_per_lowat_bytes_and_gets_its_tail():
  """`sockets.recv_into` of 4 MiB over TCP, sent in 64 KiB pieces a millisecond apart: read in pieces of at least LOWAT_BYTES (not one per segment), the last bytes included, and SO_RCVLOWAT is 1 again after."""
  from multihost._src.runtime.deadline import Deadline
  from multihost._src.transport.tcp import sockets
  listener = socket.create_server(('127.0.0.1', 0))
  sender = socket.create_connection(listener.getsockname())
  plain, _ = listener.accept()
  reader = _Counting(plain.family, plain.type, plain.proto,
                     fileno=plain.detach())
  reader.settimeout(sockets.SLICE_S)
  n = 4 << 20
  data = np.random.default_rng(0).integers(0, 256, n, np.uint8).tobytes()
  tail = 1000  # The last piece: far below LOWAT_BYTES.

  def send():
    view = memoryview(data)
    for at in range(0, n - tail, 64 << 10):
      sender.sendall(view[at:min(at + (64 << 10), n - tail)])
      time.sleep(0.001)
    time.sleep(0.05)  # The tail comes alone, after the rest was read.
    sender.sendall(view[n - tail:])

  thread = threading.Thread(target=send)
  thread.start()
  try:
    out = bytearray(n)
    started = time.monotonic()
    sockets.recv_into(reader, memoryview(out),
                      Deadline('test', time.monotonic() + 10, None))
    took = time.monotonic() - started
  finally:
    thread.join(10)
    for s in (sender, reader, listener):
      s.close()
  assert bytes(out) == data
  assert took < 5, took  # The tail did not wait for more bytes.
  # 64 pieces of 64 KiB: one wake-up each without SO_RCVLOWAT.
  assert reader.calls <= n // sockets.LOWAT_BYTES + 4, reader.calls


def _links(timeout: float):
  """(a, b, sender, reader): a socket pair with `timeout`, and the two ends of one link over it (`frames.Link`, the keys mirrored)."""
  from multihost._src.transport.tcp import frames
  a, b = socket.socketpair()
  for s in (a, b):
    s.settimeout(timeout)
  return (a, b, frames.Link(a, b'k' * 32, b'j' * 32),
          frames.Link(b, b'j' * 32, b'k' * 32))


def test_a_link_reads_ahead_and_returns_every_byte_in_order():
  """`frames.Link`: a small frame's header read also takes its body and the next frame's start (one read); the next reads return those bytes first, in order, then the socket's; bytes read ahead count as an open link after the peer closed."""
  from multihost._src.runtime.deadline import Deadline
  from multihost._src.transport.tcp import frames
  a, b, sender, reader = _links(0.25)  # as the links' sockets are
  try:
    payload = np.random.default_rng(0).integers(
        0, 256, 3 * frames.AHEAD + 5, dtype=np.uint8)
    # An agreement-sized frame, then a data frame larger than AHEAD.
    a.sendall(sender.frame(1, 29) + bytes(range(29))
              + sender.frame(2, len(payload)) + payload.tobytes())
    deadline = Deadline('test', time.monotonic() + 5)
    assert reader.check(reader.take(frames.FRAME_SIZE, deadline), 'test',
                        0) == (1, 29)
    # The body and the next header came with that one read.
    assert reader._end - reader._at >= 29 + frames.FRAME_SIZE
    assert reader.take(29, deadline) == bytes(range(29))
    reader.read_frame(2, len(payload), 'test', 0, deadline)
    got = np.empty_like(payload)
    reader.recv_into(memoryview(got), deadline)
    np.testing.assert_array_equal(got, payload)
    assert reader._at == reader._end == 0
    assert reader.open_at_peer()  # nothing waiting, the peer's side open
    # Bytes read ahead are the peer's: the link is open while they last.
    a.sendall(sender.frame(3, 4) + b'tail')
    a.close()
    assert reader.open_at_peer()  # (bytes waiting before the peer's close)
    reader.read_frame(3, 4, 'test', 0, deadline)
    assert reader.open_at_peer()
    assert reader.take(4, deadline) == b'tail'
    assert not reader.open_at_peer()
  finally:
    a.close()
    b.close()


def test_a_link_read_that_times_out_keeps_what_came_for_the_next():
  """A header read that times out with part of the frame read ahead (the link stays for the next call): the next read still returns the frame whole and in order."""
  from multihost._src.runtime.deadline import Deadline
  from multihost._src.transport.tcp import frames
  a, b, sender, reader = _links(0.05)
  try:
    first = sender.frame(1, 4) + b'body'
    second = sender.frame(2, 3) + b'xyz'
    # A frame, and the first 10 bytes of the next one behind it.
    a.sendall(first + second[:10])
    soon = Deadline('test', time.monotonic() + 5)
    reader.read_frame(1, 4, 'test', 0, soon)
    assert reader.take(4, soon) == b'body'
    # 4 more bytes come; the rest of the header does not, in time.
    a.sendall(second[10:14])
    with pytest.raises(TimeoutError):
      reader.take(frames.FRAME_SIZE, Deadline('test', time.monotonic() + 0.2))
    a.sendall(second[14:])
    reader.read_frame(2, 3, 'test', 0, soon)
    assert reader.take(3, soon) == b'xyz'
  finally:
    a.close()
    b.close()


def test_a_data_frame_is_read_into_its_view_header_first_checked():
  """`Link.read_frame_into`: a frame sent whole, one whose header came partly ahead or in pieces, each read into the view whole; a header that is not the one expected raises at once, not after waiting for a payload that will not come."""
  import multihost  # noqa: F401  (its errors name the process)
  from multihost._src.runtime import errors
  from multihost._src.runtime.deadline import Deadline
  a, b, sender, reader = _links(0.05)
  try:
    soon = Deadline('test', time.monotonic() + 5)
    payload = np.random.default_rng(1).integers(0, 256, 300_000, np.uint8)
    got = np.zeros_like(payload)

    def send_later(data: bytes, after: float) -> threading.Thread:
      thread = threading.Thread(target=lambda: (time.sleep(after),
                                                a.sendall(data)))
      thread.start()
      return thread

    # Sent whole, while the reader waits (more than a socket buffer).
    sending = send_later(sender.frame(1, len(payload)) + payload.tobytes(),
                         0.02)
    reader.read_frame_into(1, memoryview(got), 'test', 0, soon)
    sending.join()
    np.testing.assert_array_equal(got, payload)
    # A small frame, then the next one's first 30 bytes, read ahead by
    # `take`; its header's rest and its payload come later, in two pieces.
    first = sender.frame(2, 2) + b'ok'
    frame = sender.frame(3, 9) + b'123456789'
    a.sendall(first + frame[:30])
    reader.read_frame(2, 2, 'test', 0, soon)
    assert reader.take(2, soon) == b'ok'
    assert reader._end - reader._at == 30
    sending = send_later(frame[30:45], 0.02)
    later = send_later(frame[45:], 0.05)
    small = bytearray(9)
    reader.read_frame_into(3, memoryview(small), 'test', 0, soon)
    sending.join()
    later.join()
    assert bytes(small) == b'123456789' and reader._at == reader._end == 0
    # Not the call expected: raised once the header is in, the payload's
    # 100 000 bytes never sent.
    a.sendall(sender.frame(5, 100_000) + b'x' * 10)
    start = time.monotonic()
    with pytest.raises(errors.MultihostError, match='out of step'):
      reader.read_frame_into(4, memoryview(bytearray(100_000)), 'test', 0,
                             soon)
    assert time.monotonic() - start < 1
  finally:
    a.close()
    b.close()


def _tcp_pair(send_buffer: int | None = None):
  """(sender, reader, listener): a loopback TCP connection, both ends with the links' slice timeout."""
  from multihost._src.transport.tcp import sockets
  listener = socket.create_server(('127.0.0.1', 0))
  sender = socket.create_connection(listener.getsockname())
  if send_buffer is not None:
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
  reader, _ = listener.accept()
  for s in (sender, reader):
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.settimeout(sockets.SLICE_S)
  return sender, reader, listener


def _read_all(reader: socket.socket, n: int, out: list, pause: float = 0.0):
  got = bytearray()
  while len(got) < n:
    piece = reader.recv(min(n - len(got), 16 << 10))
    if not piece:
      break
    got += piece
    time.sleep(pause)
  out.append(bytes(got))


@pytest.mark.parametrize('already', [0, 7, 40, 40 + 5000, 40 + (1 << 20)])
def test_a_sent_frame_arrives_whole_and_in_order_and_the_source_copies_it(
    already):
  """`payload.send_and_copy` of a frame header and a large part (the header goes out with the payload behind it, in one write), through a small send buffer: the reader gets every byte not sent before (`already`) in order, and the source's copy is the payload."""
  from multihost._src.runtime.deadline import Deadline
  from multihost._src.transport.tcp import payload
  rng = np.random.default_rng(already)
  head = rng.integers(0, 256, 40, np.uint8).tobytes()
  parts = [rng.integers(0, 256, (1 << 20) + 3, np.uint8),
           rng.integers(0, 256, 100, np.uint8)]
  whole = head + b''.join(p.tobytes() for p in parts)
  sender, reader, listener = _tcp_pair(send_buffer=16 << 10)
  got: list = []
  thread = threading.Thread(target=_read_all,
                            args=(reader, len(whole) - already, got, 0.0005))
  thread.start()
  try:
    out = np.zeros(len(whole) - len(head), np.uint8)
    link = type('Link', (), {'sock': sender})()
    payload.send_and_copy(link, payload.segments(head, parts), len(head),
                          out, Deadline('test', time.monotonic() + 20),
                          already)
    thread.join(20)
  finally:
    for s in (sender, reader, listener):
      s.close()
  assert got and got[0] == whole[already:]
  assert out.tobytes() == whole[len(head):]


def test_send_ready_sends_a_prefix_without_waiting():
  """`sockets.send_ready`: at most `limit` bytes, the start of the views in order; on a full buffer it returns what went (not waiting), and a blocking socket stays blocking."""
  from multihost._src.transport.tcp import sockets
  sender, reader, listener = _tcp_pair(send_buffer=16 << 10)
  try:
    views = [memoryview(b'h' * 40), memoryview(bytes(range(256)) * 4096)]
    whole = b''.join(views)
    assert sockets.send_ready(sender, views, 100) == 100
    got = b''
    while len(got) < 100:
      got += reader.recv(100 - len(got))
    assert got == whole[:100]
    sender.settimeout(None)  # blocking: send_ready must not block
    started = time.monotonic()
    sent = sockets.send_ready(sender, [memoryview(whole)[100:]], 1 << 62)
    assert time.monotonic() - started < 1
    assert 0 < sent < len(whole) - 100  # the buffers filled
    assert sender.gettimeout() is None
  finally:
    for s in (sender, reader, listener):
      s.close()
  # More views than one write takes (IOV_MAX is 1024 on Linux): a prefix.
  sender, reader, listener = _tcp_pair()
  try:
    small = [memoryview(bytes([i % 256]) * 10) for i in range(1500)]
    sent = sockets.send_ready(sender, small, 1 << 62)
    assert 0 < sent <= 15000
    got = b''
    while len(got) < sent:
      got += reader.recv(sent - len(got))
    assert got == b''.join(small)[:sent]
  finally:
    for s in (sender, reader, listener):
      s.close()
