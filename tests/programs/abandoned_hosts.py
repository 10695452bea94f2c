"""Creates 2 simulated hosts, prints their name, and sleeps without ever tearing them down (the test SIGKILLs it)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import time


def _netns():
  """multihost/netns.py by itself (it needs only the standard library).

  The package's __init__ would import JAX, which this program never uses.
  """
  package = importlib.util.find_spec('multihost')  # Locates; runs nothing.
  assert package is not None and package.origin, 'multihost is not installed'
  spec = importlib.util.spec_from_file_location(
      'multihost_netns_alone', pathlib.Path(package.origin).parent / 'netns.py')
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def main() -> None:
  net = _netns().SimulatedHosts(2).__enter__()
  print(net.name, flush=True)
  time.sleep(600)


if __name__ == '__main__':
  main()
