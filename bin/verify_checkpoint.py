"""Checks a `recovery` checkpoint folder: structure, digest and step.

Reads every committed step (or --step), restores its whole transition state
as NumPy arrays, checks the stored shapes against the array metadata, the
state's digest against the one saved with it (by the digest algorithm the
checkpoint names: this version's, or the earlier one that digested 64-bit
NumPy leaves as 32-bit casts), and the step number, prints a summary and
exits 1 when anything is wrong (2 for bad usage).

It prints one line per step and logs only warnings and errors; absl's
--verbosity=0 adds recovery's INFO lines, --verbosity=1 every line of every
library (see recovery.quiet_third_party_noise).

  python bin/verify_checkpoint.py --checkpoint_dir=/tmp/ckpt
"""

from __future__ import annotations

import sys

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np

import recovery

_CHECKPOINT_DIR = flags.DEFINE_string('checkpoint_dir', None,
                                      'The checkpoint folder to check.')
_STEP = flags.DEFINE_integer('step', None,
                             'Check only this step (default: every step).')


def check_step(checkpoints: recovery.Checkpoints, step: int) -> str:
  """Verifies one step; returns its summary line or raises CheckpointError."""
  meta = checkpoints.read_meta(step)
  tree = checkpoints.stored_tree(step)
  stored = recovery.TransitionState(
      user=tree['user'],
      key=jax.random.wrap_key_data(np.asarray(tree['data']['key']),
                                   impl=meta.get('key_impl', 'threefry2x32')),
      order=tree['data']['order'], cursor=0, epoch=0, step=0)
  state = checkpoints.restore(stored, step=step)
  leaves = ', '.join(f'{k} {tuple(v[0])} {v[1]}'
                     for k, v in sorted(meta['leaves'].items())
                     if k.startswith('user/'))
  return (f'step {state.step}: OK epoch {state.epoch} cursor {state.cursor} '
          f'digest {meta["digest"][:16]} ({meta["digest_algorithm"]}) '
          f'saved by {meta["process_count"]} '
          f'processes / {meta["device_count"]} devices ({meta["reason"]}); '
          f'user state: {leaves}')


def main(argv):
  del argv  # Unused.
  if not flags.FLAGS['verbosity'].present:
    # A report, not a run: INFO lines only on request (--verbosity=0).
    logging.set_verbosity(logging.WARNING)
  recovery.quiet_orbax_logs()
  recovery.quiet_third_party_noise()
  directory = _CHECKPOINT_DIR.value
  try:
    checkpoints = recovery.Checkpoints(directory, read_only=True)
  except recovery.CheckpointError as e:
    print(f'FAIL: {e}', flush=True)
    sys.exit(1)
  with checkpoints:  # Closes Orbax's manager before the interpreter exits.
    sys.exit(verify(checkpoints))


def verify(checkpoints: recovery.Checkpoints) -> int:
  """Prints the folder's summary and a line per step; returns the exit status."""
  steps = checkpoints.steps()
  print(f'Checkpoint folder: {checkpoints.directory}')
  print(f'Committed steps: {steps}')
  if checkpoints.partial_steps:
    print(f'Partial (uncommitted, ignored) saves: {checkpoints.partial_steps}')
  if _STEP.value is not None:
    if _STEP.value not in steps:
      print(f'FAIL: no committed checkpoint step {_STEP.value}.', flush=True)
      return 1
    steps = [_STEP.value]
  if not steps:
    print('FAIL: no committed checkpoint in this folder.', flush=True)
    return 1
  failures = 0
  for step in steps:
    try:
      print(check_step(checkpoints, step), flush=True)
    except recovery.CheckpointError as e:
      failures += 1
      print(f'step {step}: FAIL {type(e).__name__}: {e}', flush=True)
  if failures:
    print(f'FAIL: {failures} of {len(steps)} checkpoints are bad.', flush=True)
    return 1
  print(f'OK: {len(steps)} checkpoints verified; latest step {steps[-1]}.')
  return 0


if __name__ == '__main__':
  flags.mark_flag_as_required('checkpoint_dir')
  app.run(main)
