"""Echoes 16 bytes back to each client of port 7000 at address argv[1]; prints 'listening' once bound."""

from __future__ import annotations

import socket
import sys


def main() -> None:
  s = socket.create_server((sys.argv[1], 7000))
  print('listening', flush=True)
  while True:
    c, _ = s.accept()
    c.sendall(c.recv(16))
    c.close()


if __name__ == '__main__':
  main()
