"""Strangers hold every data-plane port with handshakes that trickle one byte every 4 s; the job's all-gathers must still succeed.

At 3 processes, after a first broadcast (a chain 0 -> 1 -> 2, so the pair
(0, 2) is not yet connected), a thread of process 1 keeps SOCKETS
connections open to each process's data-plane port, each sending one byte
of a handshake every 4 s and reopened as soon as it is closed; then every
process runs GATHERS all-gathers and prints GATHERS OK (or raises).
"""

from __future__ import annotations

import socket
import threading
import time

import jax
import numpy as np

import multihost
from multihost import lowlevel

SOCKETS = 40
GATHERS = 5


def address(p: int) -> tuple[str, int]:
  host, port = lowlevel.key_value_get(
      f'multihost_transport/{p}', 10).decode().split('|')[:2]
  return host, int(port)


def trickle(targets, stop: threading.Event, counts: dict) -> None:
  """Keeps SOCKETS trickling connections per target until `stop`."""
  held: list[tuple[socket.socket, tuple[str, int]]] = []

  def fill() -> None:
    for target in targets:
      have = sum(1 for _, t in held if t == target)
      for _ in range(SOCKETS - have):
        try:
          held.append((socket.create_connection(target, timeout=2), target))
          counts['opened'] += 1
        except OSError:
          pass

  fill()
  while not stop.wait(4.0):
    alive = []
    for s, target in held:
      try:
        s.sendall(b'M')  # one byte of a hello, every 4 s
        alive.append((s, target))
      except OSError:
        s.close()
    held[:] = alive
    fill()
  for s, _ in held:
    s.close()


def main() -> None:
  multihost.initialize()
  me = jax.process_index()
  rows = np.arange(1 << 16, dtype=np.float32)
  multihost.broadcast_one_to_all(rows)
  stop = threading.Event()
  counts = {'opened': 0}
  attacker = None
  if me == 1:
    targets = [address(p) for p in range(3)]
    attacker = threading.Thread(target=trickle, args=(targets, stop, counts),
                                daemon=True)
    attacker.start()
    time.sleep(6.0)  # past one handshake deadline: the slots churn
  multihost.sync_global_devices('trickling')
  for i in range(GATHERS):
    got = multihost.process_allgather(rows + 1000 * me + i)
    for p in range(3):
      np.testing.assert_array_equal(got[p], rows + 1000 * p + i)
  print('GATHERS OK', flush=True)
  multihost.sync_global_devices('gathered')
  if attacker is not None:
    stop.set()
    attacker.join(10)
    print('OPENED', counts['opened'], flush=True)


if __name__ == '__main__':
  main()
