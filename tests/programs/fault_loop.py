"""One collective in a loop until argv[2] seconds passed (MODE argv[1]: barrier, save, allgather, broadcast); prints LOOP, then DONE, or 'ERROR at <time>' and exits 3.

MODE 'save' saves a 64 MiB recovery.TransitionState to argv[3] each step.
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np

import multihost


def main() -> None:
  multihost.initialize()
  mode, limit = sys.argv[1], float(sys.argv[2])
  big = np.full(64 << 20, jax.process_index() + 1, np.uint8)
  if mode == 'save':
    import recovery  # noqa: PLC0415 (only this mode needs it)
    sampler = recovery.EpochSampler(8, 4)
    key, order = sampler.start(jax.random.key(0))
    state = recovery.TransitionState(
        user={'w': np.ones(16 << 20, np.float32)}, key=key, order=order,
        cursor=0, epoch=0, step=0)
    ckpt = recovery.Checkpoints(sys.argv[3], keep=1)
  t0 = time.monotonic()
  k = 0
  try:
    while True:
      if mode == 'barrier':
        multihost.sync_global_devices(f's{k}')
      elif mode == 'save':
        state = state.replace(step=k + 1)
        ckpt.save(state, force=True)
        ckpt.wait()
      elif mode == 'allgather':
        out = multihost.process_allgather(big)
        assert out.shape == (2, 64 << 20) and out[1, -1] == 2, out.shape
      else:
        out = multihost.broadcast_one_to_all(big)
        assert out[-1] == 1
      k += 1
      if k == 2:
        print('LOOP', flush=True)
      stop = multihost.broadcast_one_to_all(
          np.array(time.monotonic() - t0 > limit))
      if bool(stop):
        break
  except Exception as e:  # noqa: BLE001
    print(f'ERROR at {time.time():.3f} {type(e).__name__}: {e}', flush=True)
    sys.exit(3)
  print(f'DONE iterations={k}', flush=True)


if __name__ == '__main__':
  main()
