"""Where a small call's time goes at P=2: a controller program for `multihost.launch`, timing layer by layer from one Python round trip up to our calls.

  python -m multihost.launch --num_processes=2 -- python bench/cost.py

In the same two processes, in interleaved rounds, each case back to back
(`--calls` per round), per call: the wall time (median over rounds of the
slower process), the CPU time of each process (`time.process_time`: every
thread), and each process's voluntary context switches (sleeps: the waits
for the peer). The cases, each one layer on the one before:

1. `round trip`: an 8-byte Python ping-pong over a local socket (the floor,
   as `bench/reference.py` `RoundTrip`);
2. `round trip, socket timeout`: the same on a socket with a Python
   timeout, as our links' sockets have (Python polls before each read);
3. `framed round trip`: that with our frame header on each message (a
   frame number and a keyed BLAKE2b MAC, made and checked by
   `transport.tcp.frames.Link`, read as the links read: the header's read
   also takes the body when it has come, `Link.take`);
4. `barrier`: `multihost.sync_global_devices` (one agreement over the
   links: call numbering, the flight record, the deadlines and liveness
   checks, the agreement's digest and frame);
5. `broadcast 8 B`, `all-gather 8 B`: the array calls (the pytree, the
   header and its digest, the inline payload, the result arrays).

The differences between rows say what each layer costs; the CPU column
is what an oversubscribed or busy machine pays for it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402  pylint: disable=g-import-not-at-top
from bench import reference  # noqa: E402
from bench.harness import Settings  # noqa: E402
import multihost  # noqa: E402
from multihost._src.transport.tcp import frames  # noqa: E402
from multihost._src.transport.tcp import sockets  # noqa: E402

# The framed round trip's keys (a benchmark's: nothing to protect).
_KEY_0_TO_1, _KEY_1_TO_0 = b'0' * 32, b'1' * 32


class FramedRoundTrip:
  """The round trip with a frame header (number and MAC) on each 8-byte message, as our links send them."""

  def __init__(self, settings: Settings):
    self.pid = jax.process_index()
    self.server, conn = reference.connect_0_and_1(settings, local=True)
    self.link = None
    if conn is not None:
      keys = ((_KEY_0_TO_1, _KEY_1_TO_0) if self.pid == 0
              else (_KEY_1_TO_0, _KEY_0_TO_1))
      self.link = frames.Link(conn, *keys)
      conn.settimeout(sockets.SLICE_S)  # As the links' sockets are.
    self.body = b'pingping'
    self.call = 0

  def _send(self) -> None:
    sockets.send_all(self.link.sock, self.link.frame(self.call, 8) + self.body,
                     None)

  def _take(self) -> None:
    self.link.read_frame(self.call, 8, 'cost', 1 - self.pid)
    self.link.take(8)

  def __call__(self) -> None:
    self.call += 1
    if self.pid == 0:
      self._send()
      self._take()
    elif self.pid == 1:
      self._take()
      self._send()

  def close(self) -> None:
    for s in (self.link and self.link.sock, self.server):
      if s is not None:
        s.close()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--calls', type=int, default=2000,
                      help='back-to-back calls of each case per round')
  parser.add_argument('--rounds', type=int, default=7)
  parser.add_argument('--json', default='',
                      help='also write the rows here (process 0)')
  args = parser.parse_args()
  multihost.initialize()
  if jax.process_count() != 2:
    raise SystemExit('bench/cost.py runs at 2 processes: '
                     'python -m multihost.launch --num_processes=2 -- '
                     'python bench/cost.py')
  settings = Settings()
  x8 = np.zeros(2, np.float32)
  floor = reference.RoundTrip(settings, local=True)
  timed = reference.RoundTrip(settings, local=True)
  if timed.conn is not None:
    timed.conn.settimeout(sockets.SLICE_S)
  framed = FramedRoundTrip(settings)
  cases = [
      ('round trip (local socket)', floor),
      ('round trip, socket timeout', timed),
      ('framed round trip', framed),
      ('barrier', lambda: multihost.sync_global_devices('b')),
      ('broadcast 8 B', lambda: multihost.broadcast_one_to_all(x8)),
      ('all-gather 8 B', lambda: multihost.process_allgather(x8)),
  ]
  for _, fn in cases:  # Warm-up: connections, caches.
    for _ in range(200):
      fn()
  samples = np.zeros((args.rounds, len(cases), 3))
  for r in range(args.rounds):
    for c, (_, fn) in enumerate(cases):
      samples[r, c] = harness.usage_per_call(fn, args.calls, settings)
  for ref in (floor, timed, framed):
    ref.close()
  every = multihost.process_allgather(samples)  # (process, round, case, 3)
  if jax.process_index() != 0:
    return
  wall = np.median(every[:, :, :, 0].max(axis=0), axis=0)
  cpu = np.median(every[:, :, :, 1], axis=1)  # (process, case)
  sleeps = np.median(every[:, :, :, 2], axis=1)
  rows = []
  print(f'Per call at P=2, medians of {args.rounds} interleaved rounds of '
        f'{args.calls} back-to-back calls ({os.cpu_count()} cores, load '
        f'{os.getloadavg()[0]:.2f}):\n')
  print('| case | wall ms | CPU ms p0 | CPU ms p1 | sleeps p0 | sleeps p1 '
        '| wall over the row above |')
  print('|---|---|---|---|---|---|---|')
  for c, (name, _) in enumerate(cases):
    barrier = len(cases) - 3
    above = (f'{wall[c] - wall[c - 1]:+.3f} ms' if 0 < c <= barrier + 1 else
             f'{wall[c] - wall[barrier]:+.3f} ms over the barrier' if c
             else '')
    print(f'| {name} | {wall[c]:.3f} | {cpu[0, c]:.3f} | {cpu[1, c]:.3f} | '
          f'{sleeps[0, c]:.2f} | {sleeps[1, c]:.2f} | {above} |')
    rows.append({'case': name, 'wall_ms': float(wall[c]),
                 'cpu_ms': [float(cpu[0, c]), float(cpu[1, c])],
                 'sleeps': [float(sleeps[0, c]), float(sleeps[1, c])]})
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump({'calls': args.calls, 'rounds': args.rounds, 'rows': rows}, f,
                indent=1)


if __name__ == '__main__':
  main()
