"""Process 0 exits at once; the others sleep 60 s."""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
  if os.environ['JAX_PROCESS_ID'] == '0':
    sys.exit(0)
  time.sleep(60)


if __name__ == '__main__':
  main()
