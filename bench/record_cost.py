"""Measures the per-call cost of a collective's trace record and jax.monitoring metrics (one process, no peers).

  python bench/record_cost.py

Times a stand-in collective that only begins and ends a flight record (what
every rendezvous does anyway), without and with `diagnostics.metrics.recorded` (the
`done`/bytes stamps and the three `jax.monitoring` reports), best of 5 runs
of 200000 calls; then again with one no-op listener per kind registered.
Compare the difference with the 8 B broadcast's median from
`python -m multihost.launch --num_processes=2 -- python bin/bench.py
--ops=broadcast_one_to_all --sizes=8 --leaves=0`.
"""

from __future__ import annotations

import time

from jax import monitoring
import numpy as np

import multihost._src.api  # noqa: F401  Assembles the runtime.
from multihost._src.diagnostics import metrics
from multihost._src.runtime import runtime


def _per_call(fn, n: int = 200000) -> float:
  best = float('inf')
  for _ in range(5):
    t = time.perf_counter()
    for _ in range(n):
      fn()
    best = min(best, (time.perf_counter() - t) / n)
  return best


def main() -> None:
  rt = runtime.current()
  x = np.zeros(1, np.int64)

  def plain():
    record = rt.flight.begin('broadcast_one_to_all', 0, time.monotonic())
    record.end = time.monotonic()
    return x

  recorded = metrics.recorded('broadcast_one_to_all',
                               metrics.result_bytes)(plain)
  base, cost = _per_call(plain), _per_call(recorded)
  print(f'record + metrics, no listener: {(cost - base) * 1e6:.2f} us per call')
  monitoring.register_event_duration_secs_listener(lambda *a, **k: None)
  monitoring.register_scalar_listener(lambda *a, **k: None)
  cost = _per_call(recorded)
  print(f'record + metrics, one no-op listener each: '
        f'{(cost - base) * 1e6:.2f} us per call')


if __name__ == '__main__':
  main()
