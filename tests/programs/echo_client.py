"""Pings the echo server at argv[1]:7000 once (2 s timeouts); prints 'ok <seconds>' or 'fail <error type>'."""

from __future__ import annotations

import socket
import sys
import time


def main() -> None:
  t = time.monotonic()
  try:
    c = socket.create_connection((sys.argv[1], 7000), timeout=2)
    c.settimeout(2)
    c.sendall(b'ping')
    assert c.recv(16) == b'ping'
    print(f'ok {time.monotonic() - t:.6f}')
  except OSError as e:
    print(f'fail {type(e).__name__}')


if __name__ == '__main__':
  main()
