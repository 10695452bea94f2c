"""Prints, once the calls agree over the links and a striped broadcast ran, the socket family of each of this process's links: FAMILIES <json>."""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np

import multihost
from multihost._src.runtime import runtime

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _links  # noqa: E402  (a sibling module, found by path)


def main() -> None:
  multihost.initialize()
  assert _links.wait_until_up('links'), 'the links were not set up'
  want = np.arange(2 << 20, dtype=np.float32)  # 8 MiB: two stripes, lanes
  got = multihost.broadcast_one_to_all(
      want if jax.process_index() == 0 else np.zeros_like(want))
  np.testing.assert_array_equal(got, want)
  families = {str(k): link.sock.family.name
              for k, link in runtime.current().plane.conns.items()}
  print('FAMILIES ' + json.dumps(families, sort_keys=True), flush=True)


if __name__ == '__main__':
  main()
