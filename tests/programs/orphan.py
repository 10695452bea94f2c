"""Starts a child that would outlive this controller (sleep 1000), prints its pid, and exits."""

from __future__ import annotations

import subprocess


def main() -> None:
  child = subprocess.Popen(['sleep', '1000'])
  print('CHILD', child.pid, flush=True)


if __name__ == '__main__':
  main()
