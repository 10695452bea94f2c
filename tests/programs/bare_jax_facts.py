"""A bare `jax.distributed.initialize()` (the launcher's environment suffices); writes its facts and a second line."""

from __future__ import annotations

import os

import jax
from jax.experimental import multihost_utils
import numpy as np


def main() -> None:
  jax.distributed.initialize()  # No arguments: the environment suffices.
  got = multihost_utils.process_allgather(np.array([jax.process_index()]))
  # One write per line (an unbuffered print() writes the text and its
  # newline separately). Gloo prints its "[Gloo] Rank N is connected" line
  # to fd 1 in several writes from its own thread, so a fragment of it may
  # still start the line that holds ours.
  os.write(1, (f'facts {jax.process_index()} {jax.process_count()} '
               f'{jax.local_device_count()} {jax.device_count()} '
               f'{got.ravel().tolist()}\n').encode())
  os.write(1, b'second line\n')


if __name__ == '__main__':
  main()
