"""A model of the messages and rounds of one call at large P, from the algorithms (analytic, nothing measured).

* Agreement over the TCP links (dissemination): ceil(log2 P) rounds; in
  each, every process sends one message (the 16-byte digest, flags and
  inline payloads) and receives one.
* Agreement through the coordination service: every process's barrier RPC
  (and its publish and read, on the full exchange) lands on process 0's
  one server: O(P) RPCs there per call; the full exchange's reads of every
  process's key by every process move O(P^2) records.
* Chain broadcast of S bytes in chunks of C, in L stripes (one per lane,
  `MULTIHOST_TCP_LANES`, default 2) that move down their own chains at
  once: P - 1 hops per stripe; pipelined, the last process has its bytes
  after about (S / L + (P - 2) C) / the bandwidth of one stream; each
  process sends at most S.
* Ring all-gather of S bytes per process: P - 1 steps; each process sends
  and receives (P - 1) S.
"""

from __future__ import annotations

import math

CHUNK = 4 << 20
LANES = 2  # multihost's default (MULTIHOST_TCP_LANES)


def rows(processes=(2, 1024, 4096), payload: int = 64 << 20) -> list[dict]:
  """One dict per (P, what): rounds, messages per process, messages in all, at the busiest process."""
  out = []
  for p in processes:
    log = math.ceil(math.log2(p))
    out += [
        {'P': p, 'what': 'agreement over TCP links (dissemination)',
         'rounds': log, 'per_process': f'{log} sent, {log} received',
         'total': p * log, 'busiest': f'{log} + {log} messages'},
        {'P': p, 'what': 'agreement at the service (fast path barrier)',
         'rounds': 1, 'per_process': '1 RPC',
         'total': p, 'busiest': f'{p} RPCs at process 0'},
        {'P': p, 'what': 'agreement at the service (full exchange)',
         'rounds': 3, 'per_process': '3 RPCs (publish, barrier, read all)',
         'total': 3 * p, 'busiest': f'{3 * p} RPCs, {p * p} records read, '
                                    'at process 0'},
        {'P': p, 'what': f'chain broadcast of {payload >> 20} MiB '
                         f'({LANES} lanes)',
         'rounds': p - 1, 'per_process': f'<= {payload >> 20} MiB sent',
         'total': (p - 1) * LANES * math.ceil(payload / LANES / CHUNK),
         'busiest': f'pipelined per lane: last byte after '
                    f'~{payload // LANES >> 20} MiB + '
                    f'{(p - 2) * CHUNK >> 20} MiB of chunk hops'},
        {'P': p, 'what': f'ring all-gather of {payload >> 20} MiB each',
         'rounds': p - 1,
         'per_process': f'{(p - 1) * payload / 2**30:.1f} GiB sent and '
                        'received',
         'total': p * (p - 1), 'busiest': 'every process alike'},
    ]
  return out


def render(model_rows: list[dict]) -> str:
  lines = ['| P | what | rounds | per process | messages in all | busiest |',
           '|---|---|---|---|---|---|']
  for r in model_rows:
    lines.append(f'| {r["P"]} | {r["what"]} | {r["rounds"]} | '
                 f'{r["per_process"]} | {r["total"]} | {r["busiest"]} |')
  return '\n'.join(lines)
