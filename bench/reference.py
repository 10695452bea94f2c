"""Reference rows: the raw barrier, plain jitted collectives, loopback TCP, torch.distributed.

Each is what ours could at best match: the coordination-service barrier
under `sync_global_devices`, a plain jitted all-gather and psum of a
prebuilt global array, loopback TCP from process 0 to 1, and
torch.distributed (gloo) when `import torch` works.
"""

from __future__ import annotations

import itertools
import socket

import jax
import numpy as np

from bench.collectives import global_rows
from bench.collectives import process_mesh
from bench.harness import Row
from bench.harness import Settings
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
