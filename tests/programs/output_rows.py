"""A real controller whose output must reach its reader whole: `output_rows.py MODE [ARGS]`.

Each mode calls `multihost.initialize()` (from the environment of the
launcher, of `mpirun`, or of JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/
JAX_PROCESS_ID), says on stderr what file descriptor 1 was before and after
it (`fd1 before=... after=...`), runs one device collective (so gloo prints
its connection line), then:

- `burst N STATUS`: N flushed lines `line K` on stdout, a collective (all
  have written theirs), then `os._exit(STATUS)`;
- `order`: 200 flushed lines on stdout, then `ERR after 200 lines` on stderr;
- `epipe`: lines on stdout until a write fails; says how on stderr;
- `full FOLDER`: `os.write`s lines to stdout until one fails, says how on
  stderr, writes FOLDER/full.I (I: its process index), waits (up to 60 s) for FOLDER/freed, then
  writes `after K` for K in 0..4.
"""

from __future__ import annotations

import os
import sys
import time

import jax
from jax.experimental import multihost_utils
import numpy as np

import multihost


def _fd1() -> str:
  info = os.fstat(1)
  return f'{info.st_dev}:{info.st_ino}:{os.readlink("/proc/self/fd/1")}'


def _say(text: str) -> None:
  os.write(2, f'{text}\n'.encode())


def main() -> None:
  mode, args = sys.argv[1], sys.argv[2:]
  before = _fd1()
  multihost.initialize()
  _say(f'fd1 before={before} after={_fd1()}')
  multihost_utils.process_allgather(np.int32(jax.process_index()))
  if mode == 'burst':
    for k in range(int(args[0])):
      print(f'line {k}', flush=True)
    # Every process has written all of its lines before any leaves (a
    # first exit ends the job: mpirun kills the others at once).
    multihost_utils.process_allgather(np.int32(0))
    os._exit(int(args[1]))
  elif mode == 'order':
    for k in range(200):
      print(f'line {k}', flush=True)
    _say('ERR after 200 lines')
  elif mode == 'epipe':
    k = 0
    try:
      for k in range(10_000_000):
        print(f'line {k}', flush=True)
    except OSError as e:
      _say(f'stdout failed after {k} lines: {type(e).__name__} '
           f'errno {e.errno}')
      os._exit(0)
  elif mode == 'full':
    folder = args[0]
    k = 0
    try:
      for k in range(10_000_000):
        os.write(1, f'line {k}\n'.encode())
    except OSError as e:
      _say(f'stdout failed after {k} lines: {type(e).__name__} '
           f'errno {e.errno}')
    with open(os.path.join(folder, f'full.{jax.process_index()}'), 'w'):
      pass
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(folder, 'freed')):
      if time.monotonic() > deadline:
        _say('nobody freed the disk in 60 s')
        os._exit(3)
      time.sleep(0.05)
    for k in range(5):
      os.write(1, f'after {k}\n'.encode())
    os._exit(0)
  else:
    raise SystemExit(f'unknown mode {mode!r}')


if __name__ == '__main__':
  main()
