"""`multihost.initialize()` from a scheduler's variables; process 0 prints every TCP listener of its host (`ss -ltnH`) as LISTEN lines, with the data plane and every service up."""

from __future__ import annotations

import subprocess

import jax
import numpy as np

import multihost


def main() -> None:
  multihost.initialize()  # No arguments: the scheduler's variables.
  multihost.process_allgather(np.arange(4))  # The data plane listens too.
  multihost.broadcast_one_to_all(np.full(1 << 20, 7, np.uint8))
  if jax.process_index() == 0:
    out = subprocess.run(['ss', '-ltnH'], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    for line in out.splitlines():
      print('LISTEN', line.split()[3], flush=True)
  multihost.sync_global_devices('listed')
  print('DONE', flush=True)


if __name__ == '__main__':
  main()
