"""`multihost.initialize()` with no arguments (a scheduler's variables); all-gathers host names, prints RESULT <index> <count> <names>."""

from __future__ import annotations

import socket

import jax
import numpy as np

import multihost


def main() -> None:
  multihost.initialize()  # No arguments: the scheduler's variables.
  me = socket.gethostname().encode().ljust(16)
  names = multihost.process_allgather(np.frombuffer(me, np.uint8))
  big = multihost.broadcast_one_to_all(np.full(8 << 20, 7, np.uint8))
  assert big[-1] == 7
  print('RESULT', jax.process_index(), jax.process_count(),
        [bytes(n).decode().strip() for n in np.asarray(names)], flush=True)


if __name__ == '__main__':
  main()
