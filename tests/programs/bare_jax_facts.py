"""A bare `jax.distributed.initialize()` (the launcher's environment suffices); writes its facts and a second line."""

from __future__ import annotations

import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _jax_gather  # noqa: E402  (a sibling module, found by path)


def main() -> None:
  jax.distributed.initialize()  # No arguments: the environment suffices.
  got = _jax_gather.process_indices()
  # One write per line (an unbuffered print() writes the text and its
  # newline separately). Gloo prints its "[Gloo] Rank N is connected" line
  # to fd 1 in several writes from its own thread, so a fragment of it may
  # still start the line that holds ours.
  os.write(1, (f'facts {jax.process_index()} {jax.process_count()} '
               f'{jax.local_device_count()} {jax.device_count()} '
               f'{got}\n').encode())
  os.write(1, b'second line\n')


if __name__ == '__main__':
  main()
