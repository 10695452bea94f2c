"""One 4 MiB broadcast (over the data plane, which needs the job secret); prints REFUSED: and the error if it raises."""

from __future__ import annotations

import numpy as np

import multihost


def main() -> None:
  multihost.initialize()
  try:
    multihost.broadcast_one_to_all(np.zeros(1 << 20, np.float32))
  except multihost.MultihostError as e:
    print('REFUSED:', e, flush=True)


if __name__ == '__main__':
  main()
