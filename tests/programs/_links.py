"""What several test programs share: waiting until the TCP links carry the calls (imported, never run)."""

from __future__ import annotations

import time

import multihost
from multihost._src.control import links
from multihost._src.runtime import runtime


def wait_until_up(name: str) -> bool:
  """Calls `sync_global_devices(name)` until the links are set up; whether they are.

  Every process switches to the links in the same call. The bound is a
  number of calls, the same on every process, so all stop calling together;
  at 20 ms apart it outlasts the links' setup time.
  """
  for _ in range(int(links.SETUP_S / 0.02)):
    multihost.sync_global_devices(name)
    if links.usable(runtime.current()):
      return True
    time.sleep(0.02)
  return links.usable(runtime.current())
