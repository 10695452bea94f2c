"""Reference rows: the raw barrier, plain jitted collectives, loopback TCP, torch.distributed; and the references `--versus` times beside ours: a raw stream, a round trip, spinners for a busy CPU.

Each is what ours could at best match: the coordination-service barrier
under `sync_global_devices`, a plain jitted all-gather and psum of a
prebuilt global array, loopback TCP from process 0 to 1, and
torch.distributed (gloo) when `import torch` works. `RawStream` and
`RoundTrip` are one Python socket between processes 0 and 1 (over loopback
TCP, or a local socket as our links on one host use); `BusyCores` spins
one process per core.
"""

from __future__ import annotations

import itertools
import os
import socket
import time

import jax
import numpy as np

from bench.collectives import global_rows
from bench.collectives import process_mesh
from bench.harness import Row
from bench.harness import Settings
from bench.harness import barrier
from bench.harness import format_size
from bench.harness import time_reference
from bench.harness import torch_group
import multihost
from multihost import lowlevel  # The raw coordination-service barrier.


def reference_rows(sizes: list[int], repeats: int, tcp_bytes: int,
                   settings: Settings) -> list[Row]:
  """Every reference row. Collective: every process must call this."""
  rows = []
  ids = itertools.count()

  def coordination_barrier():
    lowlevel.wait_at_barrier(f'multihost-bench-ref/{next(ids)}',
                             settings.timeout)

  first, median = time_reference(coordination_barrier, repeats, settings)
  rows.append(Row('coordination service wait_at_barrier', 0, 0,
                  kind='reference', ref_ms=median, ref_first_ms=first,
                  payload='–'))
  mesh = process_mesh()
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  gather = jax.jit(lambda x: x, out_shardings=replicated)
  psum = jax.jit(jax.shard_map(
      lambda x: jax.lax.psum(x, ('processes', 'local')), mesh=mesh,
      in_specs=jax.P(('processes', 'local')), out_specs=jax.P()))
  for n in sizes:
    if n < 2**20:
      continue
    # Every device holds n bytes: the all-gather moves what process_allgather
    # does; the psum (of n-byte rows) is what a sum-based broadcast does.
    per_device = max(1, n // 4)
    x = global_rows(mesh, per_device)
    for name, fn in (('plain jitted all-gather (global array)', gather),
                     ('plain jitted psum (global array)', psum)):
      first, median = time_reference(
          lambda fn=fn, x=x: fn(x).block_until_ready(), repeats, settings)
      rows.append(Row(name, n, 1, kind='reference', ref_ms=median,
                      ref_first_ms=first,
                      payload=f'{format_size(n)} per device'))
    del x
  if jax.process_count() > 1:
    rows.append(loopback_tcp(tcp_bytes, repeats, settings))
  rows.extend(torch_rows(sizes, repeats, settings))
  return rows


def _recv_exactly(conn: socket.socket, buffer: memoryview) -> None:
  got = 0
  while got < len(buffer):
    n = conn.recv_into(buffer[got:])
    if not n:
      raise ConnectionError('loopback TCP reference: peer closed early')
    got += n


def loopback_tcp(nbytes: int, repeats: int, settings: Settings) -> Row:
  """Process 0 sends `nbytes` to process 1 over loopback TCP; 1 acks."""
  pid = jax.process_index()
  server = conn = None
  if pid == 0:
    server = socket.create_server(('127.0.0.1', 0))
    port = server.getsockname()[1]
  else:
    port = None
  port = multihost.broadcast_object(port, timeout=settings.timeout)
  if pid == 0:
    conn, _ = server.accept()
  elif pid == 1:
    conn = socket.create_connection(('127.0.0.1', port))
  payload = np.random.default_rng(4).integers(0, 255, nbytes, np.uint8)
  buffer = memoryview(bytearray(nbytes))

  def once():
    if pid == 0:
      conn.sendall(payload)
      conn.recv(1)
    elif pid == 1:
      _recv_exactly(conn, buffer)
      conn.sendall(b'k')

  try:
    first, median = time_reference(once, repeats, settings)
  finally:
    if conn is not None:
      conn.close()
    if server is not None:
      server.close()
  rate = nbytes / (median / 1e3) / 1e9
  return Row('loopback TCP, process 0 -> 1', nbytes, 1, kind='reference',
             ref_ms=median, ref_first_ms=first, payload=format_size(nbytes),
             note=f'{rate:.2f} GB/s')


def torch_rows(sizes: list[int], repeats: int,
               settings: Settings) -> list[Row]:
  """torch.distributed gloo reference rows, only when torch is installed."""
  if jax.process_count() < 2:
    return []
  dist = torch_group(settings)
  if dist is None:
    return []
  import torch  # pylint: disable=import-outside-toplevel
  rows = []
  try:
    first, median = time_reference(dist.barrier, repeats, settings)
    rows.append(Row('torch.distributed gloo barrier', 0, 0, kind='reference',
                    ref_ms=median, ref_first_ms=first, payload='–'))
    for n in sizes:
      t = torch.ones(max(1, n // 4), dtype=torch.float32)
      out = [torch.empty_like(t) for _ in range(jax.process_count())]
      for name, fn in (
          ('torch.distributed gloo broadcast',
           lambda t=t: dist.broadcast(t, 0)),
          ('torch.distributed gloo all_gather',
           lambda t=t, out=out: dist.all_gather(out, t)),
          ('torch.distributed gloo all_reduce',
           lambda t=t: dist.all_reduce(t))):
        first, median = time_reference(fn, repeats, settings)
        rows.append(Row(name, n, 1, kind='reference', ref_ms=median,
                        ref_first_ms=first, payload=format_size(n)))
    # The object collectives' counterparts, on the bench's 1 KiB object.
    obj = bytes(1024)
    gathered = [None] * jax.process_count()
    for name, fn in (
        ('torch.distributed gloo broadcast_object_list',
         lambda: dist.broadcast_object_list([obj], 0)),
        ('torch.distributed gloo all_gather_object',
         lambda: dist.all_gather_object(gathered, obj))):
      first, median = time_reference(fn, repeats, settings)
      rows.append(Row(name, len(obj), 1, kind='reference', ref_ms=median,
                      ref_first_ms=first, payload='1 KiB bytes object'))
  finally:
    dist.destroy_process_group()
  return rows


def connect_0_and_1(settings: Settings, local: bool = False):
  """(listening socket or None, connection or None): one connection between processes 0 and 1 (the others get None, None): loopback TCP with our TCP links' options (`lowlevel.tune_tcp`), or with `local` a Unix domain socket (what our links between processes on one host use).

  Collective: every process must call this (the address is broadcast).
  """
  pid, server, conn, address = jax.process_index(), None, None, None
  if pid == 0 and local:
    server = socket.socket(socket.AF_UNIX)
    server.bind(b'\0multihost-bench-' + os.urandom(8).hex().encode())
    server.listen()
    address = server.getsockname()
  elif pid == 0:
    server = socket.create_server(('127.0.0.1', 0))
    address = server.getsockname()[1]
  address = multihost.broadcast_object(address, timeout=settings.timeout)
  if pid == 0:
    conn, _ = server.accept()
  elif pid == 1 and local:
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(address)
  elif pid == 1:
    conn = socket.create_connection(('127.0.0.1', address))
  if conn is not None and not local:
    # The links' own options, so that the raw stream and the round trip
    # run on the same medium as our links (the congestion control above all:
    # `multihost._src.transport.tcp.sockets.congestion`).
    lowlevel.tune_tcp(conn)
  return server, conn


class RawStream:
  """One Python stream, process 0 -> 1 (`sendall`, `recv_into` a buffer); 1 acks. Over loopback TCP, or with `local` a Unix domain socket."""

  def __init__(self, nbytes: int, settings: Settings, local: bool = False):
    self.pid = jax.process_index()
    self.nbytes = nbytes
    self.calls = 2  # timed back to back, per round
    self.name = (f'raw {"local" if local else "TCP"} stream '
                 f'{format_size(nbytes)}')
    self.server, self.conn = connect_0_and_1(settings, local)
    self.payload = np.ones(nbytes, np.uint8)
    self.buffer = memoryview(bytearray(nbytes))

  def __call__(self) -> None:
    if self.pid == 0:
      self.conn.sendall(self.payload)
      self.conn.recv(1)
    elif self.pid == 1:
      got = 0
      while got < self.nbytes:
        k = self.conn.recv_into(self.buffer[got:])
        if not k:
          raise ConnectionError('raw stream: process 0 closed early')
        got += k
      self.conn.sendall(b'k')

  def close(self) -> None:
    for s in (self.conn, self.server):
      if s is not None:
        s.close()


class RoundTrip:
  """The floor: one 8-byte Python ping-pong between processes 0 and 1 over loopback TCP (TCP_NODELAY), or with `local` a Unix domain socket, per call."""

  NAME = 'round trip 8 B (Python ping-pong, loopback)'
  LOCAL_NAME = 'round trip 8 B (Python ping-pong, local socket)'

  def __init__(self, settings: Settings, local: bool = False):
    self.pid = jax.process_index()
    self.name = self.LOCAL_NAME if local else self.NAME
    self.nbytes, self.calls = 8, 20
    self.server, self.conn = connect_0_and_1(settings, local)
    if self.conn is not None and not local:
      self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    self.buffer = memoryview(bytearray(8))

  def _take(self) -> None:
    got = 0
    while got < 8:
      k = self.conn.recv_into(self.buffer[got:])
      if not k:
        raise ConnectionError('round trip: the peer closed early')
      got += k

  def __call__(self) -> None:
    if self.pid == 0:
      self.conn.sendall(b'pingping')
      self._take()
    elif self.pid == 1:
      self._take()
      self.conn.sendall(self.buffer)

  def close(self) -> None:
    for s in (self.conn, self.server):
      if s is not None:
        s.close()


class BusyCores:
  """One spinning process per core on this machine, for the rows with the CPU busy (a one-machine run).

  `placement` says whose children the spinners are. 'every_process' (the
  default): each controller starts its share (core k's spinner is process
  k mod P's), as a training host's own compute and data loading are its
  controller's. 'process_0': process 0 starts them all. With the kernel's
  autogroup on (Linux's default; /proc/sys/kernel/sched_autogroup_enabled),
  the scheduler shares the cores fairly between sessions first, and the
  launcher starts every controller in a session of its own: spinners
  that are all process 0's children share its session, so they contend
  with process 0 alone while the other processes run as on an idle
  machine. `close` ends them (by their own process ids).
  """

  PLACEMENTS = ('every_process', 'process_0')

  def __init__(self, settings: Settings, placement: str = 'every_process'):
    if placement not in self.PLACEMENTS:
      raise ValueError(f'BusyCores: placement {placement!r} is not one of '
                       f'{self.PLACEMENTS}.')
    self.procs: list = []
    cores = os.cpu_count() or 1
    me, count = jax.process_index(), jax.process_count()
    mine = (len(range(me, cores, count)) if placement == 'every_process'
            else cores if me == 0 else 0)
    if mine:
      import subprocess  # pylint: disable=import-outside-toplevel
      import sys  # pylint: disable=import-outside-toplevel
      for _ in range(mine):
        self.procs.append(subprocess.Popen(
            [sys.executable, '-c', 'while True: pass'],
            stdin=subprocess.DEVNULL))
    time.sleep(0.5)  # Let the spinners take their cores.
    barrier(settings)

  def close(self) -> None:
    for proc in self.procs:
      proc.kill()
    for proc in self.procs:
      proc.wait(timeout=30)
    self.procs = []
