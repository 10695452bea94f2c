"""Prints, once the calls agree over the links and a striped broadcast ran, the socket family of each of this process's links (FAMILIES <json>) and whether each holds its peer's stage (STAGES <json>).

The first broadcast goes through the source's stage where the links are
local (`transport.tcp.shared`); the second, with the stage path turned off
by hand on every process, in stripes over both lanes.
"""

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
  plane = runtime.current().plane
  want = np.arange(2 << 20, dtype=np.float32)  # 8 MiB: two stripes, lanes
  for one_host in (plane.one_host, False):
    plane.one_host = one_host
    got = multihost.broadcast_one_to_all(
        want if jax.process_index() == 0 else np.zeros_like(want))
    np.testing.assert_array_equal(got, want)
  families = {str(k): link.sock.family.name
              for k, link in plane.conns.items()}
  stages = {str(k): link.shared is not None
            for k, link in plane.conns.items()}
  print('FAMILIES ' + json.dumps(families, sort_keys=True), flush=True)
  print('STAGES ' + json.dumps(stages, sort_keys=True), flush=True)


if __name__ == '__main__':
  main()
