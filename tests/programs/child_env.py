"""After `multihost.initialize()`, a child of the controller prints whether it sees the job secret (CHILD SEES SECRET yes/no); an object all-gather shows the controller still has it."""

from __future__ import annotations

import subprocess
import sys

import jax

import multihost


def main() -> None:
  multihost.initialize()
  seen = subprocess.run(
      [sys.executable, '-c',
       'import os; print("yes" if "MULTIHOST_JOB_SECRET" in os.environ '
       'else "no")'], capture_output=True, text=True, timeout=60).stdout
  print('CHILD SEES SECRET', seen.strip(), flush=True)
  got = multihost.allgather_object(jax.process_index())
  print('GATHERED', got, flush=True)


if __name__ == '__main__':
  main()
