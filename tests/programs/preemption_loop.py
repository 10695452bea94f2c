"""Steps at a per-process pace until the preemption sync point; prints SYNC <step>."""

from __future__ import annotations

import time

import multihost


def main() -> None:
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)
  for step in range(100000):
    if multihost.reached_preemption_sync_point(step):
      print(f'SYNC {step}', flush=True)
      break
    if step == 5:
      print('READY', flush=True)
    time.sleep(0.01 * (1 + jax.process_index()))  # Processes at other paces.
  else:
    raise SystemExit('never reached the preemption sync point')


if __name__ == '__main__':
  main()
