"""Stuck-step drills with real controllers: a peer alive but stuck in its data loader makes every process leave with status 75, naming it; under --max_restarts the run heals.

* tests/programs/stuck_step.py at 2 processes: a small jitted loop under
  `multihost.step_watch()` whose step sums the global batch (a gloo
  collective across the processes); process 1 sleeps 600 s in its data
  loader of step 5. The deadline is learned (2 warm-up steps, 5x, floor
  3 s). Every process leaves by itself with exit status 75 within the
  deadline + a few seconds of the stall, and process 0 logs one line that
  names step 5 and process 1, behind, with where it is. The launcher's
  grace period outlasts that: nobody is stopped by it.
* bin/train.py at 2 processes x 2 devices under `multihost.launch
  --max_restarts=1` with `--drill_stall_at_step=8` (first attempt only):
  `recovery`'s loop watches each step by itself; attempt 0 ends with both
  processes' status 75 and the report, attempt 1 resumes from the step-5
  checkpoint and the run ends with exit status 0.

* bin/train.py at 2 x 2 with `--drill_stall_between_steps_at=8`: process
  1's main thread blocks in a signal handler raised in its per-step
  callback after step 8 (tests/multiprocess/test_chaos.py signals it from
  a thread instead: wherever the loop's code is): the loop's watched
  window has no gap, so both processes leave with 75 and process 0 names
  process 1, between steps, in its signal handler.

Without the step deadline, these runs hang until the test's bounds stop
them.
"""

from __future__ import annotations

import re
import sys
import time

from _helpers import ROOT
from _helpers import alive
from _helpers import program
from _helpers import quick_compile_env

from multihost import launch

PY = sys.executable
TRAIN = str(ROOT / 'bin' / 'train.py')
DEADLINE_S = 3.0  # The floor; the steps take milliseconds.
# Past the deadline: asking where the others are (up to 1.5 s for one that
# already left) and leaving, on a loaded 2-core machine.
LEAVE_SLACK_S = 6.0


def _report_lines(out):
  """The step deadline's reports in `out` (one per process that left).

  Not the warning of a step that raised past its deadline: where the
  stuck peer left first, the waiting process's collective fails, it says
  so, and its report follows (`liveness.step_deadline`).
  """
  return [l for l in out.splitlines()
          if ('past its deadline' in l and ' has run for ' in l)
          or (' raised after ' in l and 'left at their step deadline' in l)]


def test_a_peer_stuck_in_its_data_loader_makes_every_process_leave_with_75():
  env = quick_compile_env()
  with launch.Controllers(program('stuck_step', 5, 1, DEADLINE_S),
                          num_processes=2, env=env,
                          grace_period=60) as cluster:
    assert cluster.wait_for_output(1, 'STALL at=', timeout=90), (
        cluster.outputs[0][-3000:], cluster.outputs[1][-3000:])
    gone = {}
    bound = time.monotonic() + DEADLINE_S + LEAVE_SLACK_S + 20
    while len(gone) < 2 and time.monotonic() < bound:
      for i, pid in enumerate(cluster.pids):
        if i not in gone and not alive(pid):
          gone[i] = time.time()
      time.sleep(0.05)
    result = cluster.wait(timeout=60)
  outs = result.outputs
  stalled = float(re.search(r'STALL at=([\d.]+)', outs[1]).group(1))
  took = {i: at - stalled for i, at in gone.items()}
  print(f'deadline {DEADLINE_S:g} s; left after the stall began: {took}')
  assert result.returncodes == (75, 75), (result.summary, outs[0][-3000:],
                                          outs[1][-3000:])
  assert not result.stopped, result.summary
  assert 'DONE' not in outs[0] + outs[1]
  for i in (0, 1):
    assert DEADLINE_S <= took[i] < DEADLINE_S + LEAVE_SLACK_S, took
    assert len(_report_lines(outs[i])) == 1, outs[i][-3000:]
  assert f'LEARNED deadline={DEADLINE_S:g}' in outs[0], outs[0][-3000:]
  lines = [_report_lines(outs[i])[0] for i in (0, 1)]
  for i, line in enumerate(lines):
    assert f'[process={i}] multihost: step 5 has run for ' in line, line
    assert f'past its deadline of {DEADLINE_S:g} s (learned: 5 x ' in line, line
    assert 'Leaving with exit status 75' in line, line
  # Process 1 behind, and where it is, named by the process whose deadline
  # fired while the other was still there to answer: process 0, waiting in
  # the step's collective; or process 1 itself ("(this process)"), where on
  # a loaded machine its own deadline fired first and it left before
  # process 0 asked (seen once in CI: process 0's line then says nobody
  # answered).
  named = [line for line in lines
           if 'Behind the others: process 1 ' in line]
  assert named, lines
  line = named[0]
  assert ('is in step 5 for ' in line
          and 'not arrived at its collective part' in line), line
  assert ('Where they are: process 1: main thread in load '
          '(programs/stuck_step.py:' in line), line
  assert not any(alive(pid) for pid in result.pids)


def test_train_heals_a_stuck_step_under_max_restarts(tmp_path):
  args = [PY, TRAIN, f'--checkpoint_dir={tmp_path / "ckpt"}', '--steps=12',
          '--save_every=5', '--drill_stall_at_step=8',
          '--drill_stall_process=1', '--drill_stall_seconds=600',
          f'--step_deadline_floor={DEADLINE_S:g}', '--step_deadline_warmup=2',
          '--straggler_every=0']
  started = time.monotonic()
  result = launch.launch(args, num_processes=2, devices_per_process=2,
                         grace_period=20, kill_wait=0.5, timeout=90,
                         max_restarts=1, cwd=ROOT, env=quick_compile_env())
  took = time.monotonic() - started
  print(f'healed run: {took:.1f} s')
  assert result.ok, result.summary + '\n' + '\n'.join(
      o[-3000:] for a in result.attempts for o in a.outputs)
  assert result.restart_count == 1, result.summary
  first, last = result.attempts
  # The first to see the deadline leaves with 75 and its report; restarting
  # at once, the launcher then stops the other unless it has left with 75
  # and its report already (the plain launcher's drill above checks that
  # both leave by themselves).
  assert 75 in first.returncodes, first.summary
  for p, (rc, out) in enumerate(zip(first.returncodes, first.outputs,
                                    strict=True)):
    if rc == 75:
      assert len(_report_lines(out)) == 1, out[-3000:]
    else:
      assert p in first.stopped, first.summary
  if first.returncodes[0] == 75:  # Process 0 names the one behind.
    (line,) = _report_lines(first.outputs[0])
    assert '[process=0] multihost: step 8 has run for ' in line, line
    assert 'Behind the others: process 1 is in step 8 ' in line, line
    assert 'main thread in stall (bin/_train_flags.py:' in line, line
  else:  # The stuck process saw its own step outlast the deadline first.
    (line,) = _report_lines(first.outputs[1])
    assert '[process=1] multihost: step 8 has run for ' in line, line
  assert 'Drill: process 1 stalls' not in last.outputs[1]
  assert '[process=0] Resumed from step 5 ' in last.outputs[0]
  assert 'Finished step 12 ' in last.outputs[0]
  assert not any(alive(pid) for a in result.attempts for pid in a.pids)


def test_a_stall_between_steps_makes_every_process_leave_with_75_naming_it(
    tmp_path):
  args = [PY, TRAIN, f'--checkpoint_dir={tmp_path / "ckpt"}', '--steps=40',
          '--save_every=5', '--drill_stall_between_steps_at=8',
          '--drill_stall_process=1', '--drill_stall_seconds=600',
          f'--step_deadline_floor={DEADLINE_S:g}', '--step_deadline_warmup=2',
          '--straggler_every=0']
  result = launch.launch(args, num_processes=2, devices_per_process=2,
                         grace_period=30, kill_wait=0.5, timeout=90,
                         cwd=ROOT, env=quick_compile_env())
  outs = result.outputs
  assert result.returncodes == (75, 75), (result.summary, outs[0][-3000:],
                                          outs[1][-3000:])
  assert not result.stopped, result.summary
  stalled = float(re.search(r'stalls in a signal handler after step 8 '
                            r'\(in \w+\) for 600 s at (\d+\.\d+)',
                            outs[1]).group(1))
  assert 'Finished step' not in outs[0]
  for i in (0, 1):
    assert len(_report_lines(outs[i])) == 1, outs[i][-3000:]
  (line,) = _report_lines(outs[0])
  assert ('Behind the others: process 1 is between steps: in the '
          "program's code after step 8 for " in line), line
  assert 'process 1: main thread in handler (bin/_train_flags.py:' in line, line
  print(f'stalled at {stalled:.3f}; process 0: {line[:300]}')
  assert not any(alive(pid) for pid in result.pids)
