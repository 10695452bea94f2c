"""Real-process tests of the launcher's restarts, first-error-by-raise blame and `ps` labels.

The controller programs are the files in tests/launch_programs/; each
reads its index and attempt from the environment the launcher sets.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

from multihost import launch

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROGRAMS = ROOT / 'tests' / 'launch_programs'
PY = sys.executable


def _gone(pid: int) -> bool:
  """True when no process has this pid (or it is only a zombie)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  try:
    state = pathlib.Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1]
  except OSError:
    return True
  return state.split()[0] in ('Z', 'X')


def _cli(*flags: str, program: str) -> subprocess.CompletedProcess[str]:
  return subprocess.run(
      [PY, '-m', 'multihost.launch', '--num_processes=2', '--grace_period=5',
       *flags, '--', PY, str(PROGRAMS / program)],
      capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_max_restarts_starts_all_again_after_a_sigkill():
  proc = _cli('--max_restarts=2', program='dies_on_first_attempt.py')
  assert proc.returncode == 0, proc.stdout + proc.stderr
  for attempt in (0, 1):
    for i in (0, 1):
      assert f'[p{i}] process {i} attempt {attempt}\n' in proc.stdout
  assert 'attempt 2' not in proc.stdout
  assert '[launcher] attempt 0 failed: process 1 failed first (killed by ' \
      'SIGKILL (status 137)); restarting all 2 (restart 1 of 2).' in (
          proc.stdout)
  summary = proc.stderr
  assert 'multihost.launch: 2 attempt(s) (--max_restarts=2)' in summary
  assert ('attempt 0 (MULTIHOST_RESTART_COUNT=0) at 0.0 s: process 1 failed '
          'first (killed by SIGKILL (status 137)); restarted all (restart 1 '
          'of 2).') in summary
  assert ('attempt 1 (MULTIHOST_RESTART_COUNT=1) at ' in summary and
          'every process exited 0; the run succeeded.' in summary)


def test_without_restarts_the_failure_ends_the_run():
  proc = _cli(program='dies_on_first_attempt.py')
  assert proc.returncode == 128 + signal.SIGKILL, proc.stdout + proc.stderr
  assert 'attempt 1' not in proc.stdout
  assert '[launcher]' not in proc.stdout
  assert 'First failure: process 1 (killed by SIGKILL' in proc.stderr
  assert 'attempt(s)' not in proc.stderr


def test_a_restarted_jax_job_gets_a_fresh_coordinator():
  # Attempt 0: process 1 exits 3 before jax.distributed.initialize, so
  # process 0 waits there until the launcher stops it. Attempt 1: both meet.
  result = launch.launch([PY, str(PROGRAMS / 'jax_fails_on_first_attempt.py')],
                         num_processes=2, devices_per_process=2,
                         grace_period=1, kill_wait=0.5, timeout=120,
                         max_restarts=1)
  assert result.ok, result.summary + '\n' + '\n'.join(result.outputs)
  assert result.restart_count == 1
  first, last = result.attempts
  assert first.first_failure == 1 and first.exit_code == 3
  assert first.stopped == (0,)
  for i in range(2):
    assert f'facts {i} 2 4 [0, 1] attempt 1\n' in last.outputs[i]
  assert all(_gone(pid) for a in result.attempts for pid in a.pids)


def test_the_first_raise_is_blamed_though_its_process_exits_last(tmp_path):
  # Process 0 raises at once, then lingers at exit (as in an exit handshake
  # that waits for a peer); process 1 sleeps, then exits 1 before it.
  result = launch.launch([PY, str(PROGRAMS / 'raises_then_lingers.py')],
                         num_processes=2, grace_period=30, timeout=60,
                         env={'READY_FILE': str(tmp_path / 'ready')})
  assert result.end_times[1] < result.end_times[0], result.summary
  assert result.first_failure == 0, result.summary
  assert result.first_error == 'RuntimeError: step 3 failed'
  assert result.exit_code == 1
  assert 'Process 0 raised first, at ' in result.summary
  assert "p1 was running (last line at " in result.summary
  assert "'process 1 loading data'" in result.summary


def test_controllers_are_told_apart_in_ps():
  with launch.Controllers([PY, '-c', 'import sys, time; '
                           'print(sys._xoptions, flush=True); time.sleep(30)'],
                          num_processes=2) as cluster:
    for i in range(2):
      assert cluster.wait_for_output(i, 'multihost_process', timeout=30)
      assert f"{{'multihost_process': '{i}'}}" in cluster.output(i)
      ps = subprocess.run(['ps', '-o', 'args=', '-p', str(cluster.pids[i])],
                          capture_output=True, text=True, timeout=10).stdout
      assert f' -X multihost_process={i} -c ' in ps, ps
    pids = cluster.pids
  assert all(_gone(pid) for pid in pids)
