"""Port scans, impostors, replays and tampered frames against process 2's data-plane listener.

Usage: attacks.py MODE, at 3 processes. The first broadcast connects 0->1
and 1->2; the link 0<->2 opens at the all-gather, after the attacks on
process 2's listener. Process 2 republishes its address as a proxy that
records, and in MODE alters, the bytes of the link 0<->2 (2 -> 0):
  attack        only the scan and impostors (and the replayed handshake);
  flip          one bit of a frame header's call id;
  flip-mac      one bit of a frame header's MAC (nothing else checks it);
  flip-payload  one bit inside an object's pickled bytes;
  truncate      half a frame, then the connection ends;
  replay        a frame of the call again, before the call's next frame.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import sys
import threading
import time

import numpy as np

import multihost
from multihost import lowlevel

# A frame header: call id, byte count, frame number (8 bytes each), MAC.
_FRAME_HEAD = 24
_FRAME = _FRAME_HEAD + 16
# The connector's hello: magic, connector, acceptor, lane, nonce.
_HELLO = 4 + 4 + 4 + 1 + 16


def address(p: int) -> tuple[str, int]:
  host, port = lowlevel.key_value_get(
      f'multihost_transport/{p}', 10).decode().split('|')[:2]
  return host, int(port)


def recv_all(s: socket.socket) -> bytes:
  s.settimeout(10)
  out = b''
  while True:
    try:
      k = s.recv(4096)
    except OSError:
      return out
    if not k:
      return out
    out += k


def listen_drops() -> int:
  """SYNs the kernel dropped at full listen queues (this network namespace)."""
  with open('/proc/net/netstat') as f:
    names, values = [line.split() for line in f
                     if line.startswith('TcpExt:')][:2]
  return int(values[names.index('ListenDrops')])


def flip(data: bytes, at: int) -> bytes:
  return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]


class Proxy:
  """Forwards one connection to `real`, recording (and maybe altering) it."""

  def __init__(self, real: tuple[str, int]):
    self.real = real
    self.sock = socket.socket()
    self.sock.bind(('127.0.0.1', 0))
    self.sock.listen(1)
    self.to_client = b''   # recorded bytes 2 -> 0
    self.to_server = b''   # recorded bytes 0 -> 2
    self.frame = 0  # bytes of one frame (header and block) of the gather
    self.held = b''  # to_client bytes held back to replay from
    self.action: str | None = None
    threading.Thread(target=self.run, daemon=True).start()

  def run(self) -> None:
    client, _ = self.sock.accept()
    server = socket.create_connection(self.real)
    threading.Thread(target=self.pump, args=(client, server, 'to_server'),
                     daemon=True).start()
    self.pump(server, client, 'to_client')

  def pump(self, src: socket.socket, dst: socket.socket, name: str) -> None:
    while True:
      data = src.recv(1 << 20)
      if not data:
        dst.close()
        return
      action = self.action if name == 'to_client' else None
      if action == 'flip':
        self.action = None  # the call id's lowest byte
        data = flip(data, 0)
      elif action == 'flip-mac' and len(data) >= _FRAME:
        self.action = None  # the MAC's last byte
        data = flip(data, _FRAME - 1)
      elif action == 'flip-payload' and len(data) > 141:
        self.action = None  # a byte inside the pickled bytes' content
        data = flip(data, 140)
      elif action == 'truncate':
        self.action = None  # half a frame, then the connection ends
        dst.sendall(data[:len(data) // 2])
        for s in (dst, src):
          s.shutdown(socket.SHUT_RDWR)
        return
      elif action == 'replay':
        # The call's first frame (header and block) again, right before its
        # second: the same call id, length and an authentic MAC; only the
        # frame number is out of order.
        self.held += data
        if len(self.held) < 2 * self.frame:
          continue
        self.action = None
        data = self.held[:self.frame] + self.held
      setattr(self, name, getattr(self, name) + data)
      dst.sendall(data)


def attack(target: tuple[str, int]) -> list[socket.socket]:
  """A port scan, an HTTP client, a silent one and three impostors.

  Returns the HTTP and the silent connection, which the caller keeps open
  through the collectives that follow (they must not hold the listener up).
  """
  slow = []
  dropped_before = listen_drops()
  for _ in range(300):  # a port scan: connect and close
    start = time.monotonic()
    socket.create_connection(target, timeout=20).close()
    if time.monotonic() - start > 0.9:
      slow.append(round(time.monotonic() - start, 2))
  drops = listen_drops() - dropped_before
  # A SYN dropped by a full accept queue is sent again after 1 s: the
  # listener kept up with the scan only if connects did not wait that long.
  # One such wait is allowed, and more only where the kernel dropped no SYN
  # at a full listen queue meanwhile: then a loaded machine descheduled the
  # scanner, and the listener is not why it waited.
  assert len(slow) <= 1 or drops == 0, (
      f'scan connects took {slow} s; {drops} SYN(s) dropped at full listen '
      'queues meanwhile')
  http = socket.create_connection(target, timeout=20)
  http.sendall(b'GET / HTTP/1.0\r\n\r\n')
  silent = socket.create_connection(target, timeout=20)  # never speaks
  # Out of range, wrong direction, and a peer with a wrong secret.
  for claim in (7, 2, 0):
    s = socket.create_connection(target, timeout=20)
    nonce = os.urandom(16)
    s.sendall(struct.pack('<4sIIB16s', b'MHT4', claim, 2, 0, nonce))
    reply = s.recv(48)
    if claim != 0:
      assert reply == b'', (claim, reply)
      continue
    assert len(reply) == 48, reply
    proof = hmac.digest(b'wrong secret', b'connect', hashlib.sha256)
    s.sendall(proof)
    assert recv_all(s) == b'', 'a wrong secret was accepted'
  print('ATTACKS REFUSED', flush=True)
  return [http, silent]


def main() -> None:
  mode = sys.argv[1]
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)

  from multihost._src.control import links
  from multihost._src.runtime import runtime
  # The calls agree through the service, so that the link 0<->2 opens at
  # the all-gather, through the proxy (the agreement's own links would open
  # it at once; their frames are attacked in test_control_links.py).
  links.service_only(runtime.current())
  me = jax.process_index()
  big = np.arange(1 << 20, dtype=np.float32) + 1000 * me  # 4 MiB
  want = [np.arange(1 << 20, dtype=np.float32) + 1000 * p for p in range(3)]
  multihost.broadcast_one_to_all(big)
  # Process 1 reads process 2's real address before process 2 points the
  # others at its proxy (which accepts one connection: a scan of it would
  # fill its backlog and time out).
  target = address(2) if me == 1 and mode == 'attack' else None
  multihost.sync_global_devices('address read')

  kept_open = []
  if target is not None:
    kept_open = attack(target)

  proxy = None
  if me == 2:
    proxy = Proxy(address(2))
    # Process 2 itself points the others at the proxy (signed with its job
    # key): the proxy stands for someone on the network path.
    from multihost._src.runtime import runtime
    from multihost._src.transport.tcp import auth
    lowlevel.key_value_set('multihost_transport/2', auth.address_record(
        runtime.current().job_keys[1], 2, '127.0.0.1',
        proxy.sock.getsockname()[1]))
  multihost.sync_global_devices('attacked')

  start = time.monotonic()
  rows = multihost.process_allgather(big)
  took = time.monotonic() - start
  for p in range(3):
    np.testing.assert_array_equal(rows[p], want[p])
  print(f'GATHER OK in {took:.2f} s', flush=True)
  assert took < 5, took

  if proxy is not None:
    # Replay the recorded handshake of process 0 to the real listener.
    s = socket.create_connection(proxy.real, timeout=20)
    s.sendall(proxy.to_server[:_HELLO])
    reply = s.recv(48)
    if reply:
      s.sendall(proxy.to_server[_HELLO:_HELLO + 32])
    assert recv_all(s) == b'', 'a replayed handshake was accepted'
    print('REPLAY REFUSED', flush=True)
  # Armed only once every process has the first gather: until process 0
  # passes this barrier, process 2's bytes of it may still be in the proxy.
  multihost.sync_global_devices('armed')
  if proxy is not None:
    proxy.frame = _FRAME + big.nbytes  # every process sends as many bytes
    proxy.action = mode
  if mode == 'flip-payload':
    try:
      got = multihost.allgather_object(bytes([me]) * 300_000)
    except multihost.MultihostError as e:
      print('REFUSED:', e, flush=True)
    else:
      assert got == [bytes([p]) * 300_000 for p in range(3)], 'wrong bytes'
      print('DELIVERED CORRECT', flush=True)
  if mode in ('flip', 'flip-mac', 'replay', 'truncate'):
    try:
      rows = multihost.process_allgather(big)
    except multihost.MultihostError as e:
      print('REFUSED:', e, flush=True)
    else:
      for p in range(3):
        np.testing.assert_array_equal(rows[p], want[p])
      print('DELIVERED CORRECT', flush=True)
    if mode == 'truncate':  # stay alive while the others look for failures
      time.sleep(lowlevel.failure_detection_bound() + 3)
  for s in kept_open:
    s.close()


if __name__ == '__main__':
  main()
