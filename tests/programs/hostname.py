"""Prints this host's name and the address it resolves to."""

from __future__ import annotations

import socket


def main() -> None:
  n = socket.gethostname()
  print(n, socket.gethostbyname(n))


if __name__ == '__main__':
  main()
