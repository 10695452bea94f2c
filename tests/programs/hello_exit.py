"""Prints 'hello from <JAX_PROCESS_ID>'; process 1 exits 5, the others 0."""

from __future__ import annotations

import os
import sys


def main() -> None:
  i = os.environ['JAX_PROCESS_ID']
  print('hello from', i)
  sys.exit(5 if i == '1' else 0)


if __name__ == '__main__':
  main()
