"""Someone who reaches the coordination service plants or alters control messages.

Usage: tamper.py MODE[,MODE...] PLANTED_FILE, at 2 processes; per MODE, in
order, every process prints 'MODE <mode>', process 1 plays the attacker (it
writes keys directly, as anyone who reaches the service could), then every
process calls allgather_object and prints what it got or raised ('planted'
leaves keys of later calls behind: give it last):
  planted  a key beside every process's own, holding a pickle that would
           create PLANTED_FILE if unpickled;
  altered  process 0's message replaced by garbage and that pickle;
  resized  process 0's message with its object's size field changed and
           its bytes cut to match: it still decodes, and the message's
           MAC refuses it before anything else looks;
  flagged  process 0's message with its flag byte changed (direct to
           fell-back): it still decodes; only the MAC sees the change;
  moved    process 0's authentic message of the previous call put under
           this call's key: it decodes and its seal checks, but its MAC is
           for the other key.
"""

from __future__ import annotations

import pickle
import struct
import sys
import threading
import time

import multihost
from multihost import lowlevel

_MAC = 16  # bytes before a control message's flag and body
_RECORD = struct.Struct('<QHB')  # an object's record: see `resize`


class Evil:
  def __init__(self, path: str):
    self.path = path

  def __reduce__(self):
    return (open, (self.path, 'w'))


def own_keys() -> set[str]:
  return {k for k, _ in lowlevel.key_value_dir('multihost/')}


def latest_of_process_0() -> tuple[str, bytes]:
  """The key and stored bytes of process 0's message of the latest call."""
  found = [(int(k.split('/')[-2]), k, v) for k, v in
           lowlevel.key_value_dir('multihost/') if k.endswith('/0')]
  _, key, value = max(found)
  return key, value


def replace_next_of_process_0(before: set[str], forge) -> None:
  """Waits for process 0's next message; overwrites it with forge(stored)."""
  def tamper():
    while True:
      for key, stored in lowlevel.key_value_dir('multihost/'):
        if key not in before and key.endswith('/0'):
          lowlevel.key_value_set(key, forge(stored))
          return
      time.sleep(0.005)
  thread = threading.Thread(target=tamper, daemon=True)
  thread.start()
  thread.join(20)
  assert not thread.is_alive(), 'process 0 published nothing to tamper with'


def resize(stored: bytes) -> bytes:
  """The stored message with its object's size field one less and its bytes cut to match (so it still decodes), old MAC.

  The message's body (after the flag byte) is the object's record in the
  agreement (`objects.record`): size, seal length, inline flag, seal, bytes.
  """
  body = stored[_MAC + 1:]
  size, sealed, inline = _RECORD.unpack_from(body)
  assert inline and len(body) == _RECORD.size + sealed + size, body
  return (stored[:_MAC + 1] + _RECORD.pack(size - 1, sealed, inline)
          + body[_RECORD.size:-1])


def reflag(stored: bytes) -> bytes:
  """The stored message with its flag byte changed, old MAC."""
  assert stored[_MAC:_MAC + 1] == b'D', stored[:_MAC + 1]
  return stored[:_MAC] + b'F' + stored[_MAC + 1:]


def attempt(mode: str, me: int, evil: bytes) -> None:
  """One MODE's attack and the allgather_object it targets."""
  multihost.sync_global_devices(f'start {mode}')
  print('MODE', mode, flush=True)
  if mode == 'moved':  # an authentic message of process 0 to move
    multihost.allgather_object({'me': me, 'round': 0})
    multihost.sync_global_devices('recorded')
  if me == 1 and mode == 'planted':
    for call in range(64):  # a key beside every process's own
      lowlevel.key_value_set(f'multihost/0/{call}/00', evil)
  if me == 1 and mode == 'altered':
    replace_next_of_process_0(own_keys(), lambda _: b'x' * _MAC + evil)
  if me == 1 and mode == 'resized':
    replace_next_of_process_0(own_keys(), resize)
  if me == 1 and mode == 'flagged':
    replace_next_of_process_0(own_keys(), reflag)
  if me == 1 and mode == 'moved':
    _, recorded = latest_of_process_0()
    replace_next_of_process_0(own_keys(), lambda _: recorded)
  if me == 0 and mode in ('altered', 'resized', 'flagged', 'moved'):
    time.sleep(1)  # process 1's tamperer is watching when we publish
  if mode == 'planted':
    multihost.sync_global_devices('planted')
  try:
    got = multihost.allgather_object({'me': me, 'round': 1})
  except multihost.MultihostError as e:
    print('REFUSED:', e, flush=True)
  else:
    print('GOT', got, flush=True)


def main() -> None:
  modes, planted_file = sys.argv[1].split(','), sys.argv[2]
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)

  from multihost._src.control import links
  from multihost._src.runtime import runtime
  # The messages attacked here are the service path's (the agreement over
  # the links is attacked in test_control_links.py).
  links.service_only(runtime.current())
  me = jax.process_index()
  evil = b'D' + pickle.dumps(Evil(planted_file))
  for mode in modes:
    attempt(mode, me, evil)


if __name__ == '__main__':
  main()
