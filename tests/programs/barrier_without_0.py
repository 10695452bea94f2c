"""Bare JAX controllers print 'ready'; process 0 sleeps while the others wait at a JAX barrier."""

from __future__ import annotations

import time

import jax
from jax.experimental import multihost_utils


def main() -> None:
  jax.distributed.initialize()
  print('ready', flush=True)
  if jax.process_index() == 0:
    time.sleep(60)
  multihost_utils.sync_global_devices('never reached by process 0')


if __name__ == '__main__':
  main()
