"""Chaos: one bin/train.py run under `multihost.launch --max_restarts` takes seeded random faults, one per attempt (a SIGKILL, a SIGSTOP, a stall between steps, in a random order, each on a random process after a random step), and still ends with exit status 0 and the uninterrupted run's digest.

The faults come from `--drill_faults` (bin/_train_flags.py), drawn with
`random.Random(SEED)`; $CHAOS_SEED picks another seed (the failure message
says which one ran). Each fault lands after the step the last attempt
reached, so every attempt makes progress. A SIGKILL breaks the peer's gloo
collective; a SIGSTOPped process stops heartbeating (the others leave with
75 after the heartbeat timeout, 5 s here); a stall between steps (the main
thread blocked in a signal handler) is ended by the step deadline (floor
3 s). Bounded: well under a minute on a quiet 2-core machine.
"""

from __future__ import annotations

import os
import random
import sys
import time

from _helpers import ROOT
from _helpers import alive
from _helpers import quick_compile_env

from multihost import env as mh_env
from multihost import launch

PY = sys.executable
TRAIN = str(ROOT / 'bin' / 'train.py')
SEED = int(os.environ.get('CHAOS_SEED', '71'))
STEPS = 60


def _args(folder, *extra):
  return [PY, TRAIN, f'--checkpoint_dir={folder}', f'--steps={STEPS}',
          '--save_every=5', '--step_deadline_floor=3',
          '--step_deadline_warmup=2', '--straggler_every=0', *extra]


def _faults(rng: random.Random) -> list[str]:
  """One fault per attempt, each after the step the attempt before reached."""
  kinds = ['kill', 'stop', 'stall']
  rng.shuffle(kinds)
  faults, step = [], 4
  for attempt, kind in enumerate(kinds):
    step = rng.randint(step + 4, step + 14)
    faults.append(f'{attempt}:{kind}:{rng.randrange(2)}:{step}')
  return faults


def _digest(output: str) -> str:
  (line,) = [l for l in output.splitlines() if 'Finished step' in l]
  return line.split(' digest ')[1].split()[0]


def _run(args, max_restarts):
  env = {**quick_compile_env(), mh_env.HEARTBEAT: '5'}
  return launch.launch(args, num_processes=2, devices_per_process=2,
                       grace_period=20, kill_wait=0.5, timeout=150,
                       max_restarts=max_restarts, cwd=ROOT, env=env)


def test_random_faults_during_one_run_end_with_the_uninterrupted_digest(
    tmp_path):
  faults = _faults(random.Random(SEED))
  said = f'seed {SEED} ($CHAOS_SEED), faults {faults}'
  reference = _run(_args(tmp_path / 'reference'), 0)
  assert reference.ok, reference.summary
  started = time.monotonic()
  result = _run(_args(tmp_path / 'chaos', f'--drill_faults={",".join(faults)}'),
                len(faults))
  took = time.monotonic() - started
  print(f'{said}: {took:.1f} s, {result.restart_count} restarts')
  assert result.ok, (said, result.summary, '\n'.join(
      o[-2000:] for a in result.attempts for o in a.outputs))
  assert result.restart_count == len(faults), (said, result.summary)
  for attempt, fault in zip(result.attempts, faults, strict=False):
    kind = fault.split(':')[1]
    assert f': {kind} after step ' in ''.join(attempt.outputs), (
        said, attempt.summary)
  assert _digest(result.attempts[-1].outputs[0]) == _digest(
      reference.outputs[0]), said
  assert not any(alive(pid) for a in result.attempts for pid in a.pids)
