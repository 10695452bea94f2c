"""A run that opens recovery.Checkpoints on a folder on cue, and holds it (tests).

  python tests/folder_holder.py FOLDER

Reads commands from stdin, one a line:
  go T      at time.time() == T, open `recovery.Checkpoints(FOLDER)`; print
            'won' when it holds the folder, or 'refused <message>'
  release   close the folder if held; print 'released'
  quit      exit
Nothing here imports jax.distributed: each contender is a single controller.
"""

from __future__ import annotations

import sys
import time

import recovery


def main(folder: str) -> None:
  held = None
  for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == 'go':
      start = float(args[0])
      while time.time() < start:  # spin, so that both enter at once
        pass
      try:
        held = recovery.Checkpoints(folder, async_save=False)
        print('won', flush=True)
      except recovery.CheckpointError as e:
        print('refused', str(e).replace('\n', ' '), flush=True)
    elif cmd == 'release':
      if held is not None:
        held.close()
        held = None
      print('released', flush=True)
    elif cmd == 'quit':
      return


if __name__ == '__main__':
  main(sys.argv[1])
