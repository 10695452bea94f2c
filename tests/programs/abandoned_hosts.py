"""Creates 2 simulated hosts, prints their name, and sleeps without ever tearing them down (the test SIGKILLs it)."""

from __future__ import annotations

import time

from multihost import netns  # Imports no JAX (multihost's names load lazily).


def main() -> None:
  net = netns.SimulatedHosts(2).__enter__()
  print(net.name, flush=True)
  time.sleep(600)


if __name__ == '__main__':
  main()
