"""Real-process tests of the launcher's restarts (at once, not after status 78, one compilation cache), first-error-by-raise blame and `ps` labels.

The controller programs are the files in tests/launch_programs/; each
reads its index and attempt from the environment the launcher sets.
"""

from __future__ import annotations

import io
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

from multihost import env as env_lib
from multihost import launch
from multihost.launch._src.processes import output as _output
from multihost.launch._src.processes import processes as _processes

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


def _cli(*flags: str, program: str,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
  return subprocess.run(
      [PY, '-m', 'multihost.launch', '--num_processes=2', '--grace_period=5',
       *flags, '--', PY, str(PROGRAMS / program)],
      capture_output=True, text=True, timeout=120, cwd=ROOT,
      env={**os.environ, **(env or {})})


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


def _fails_as_told(*, max_restarts: int, grace_period: float = 30.0,
                   **env: str) -> launch.LaunchResult:
  """tests/launch_programs/fails_as_told.py as 2 controllers (`env`: how it fails)."""
  return launch.launch([PY, str(PROGRAMS / 'fails_as_told.py')],
                       num_processes=2, grace_period=grace_period,
                       timeout=120, max_restarts=max_restarts, env=env)


def test_with_restarts_left_the_others_are_stopped_at_once():
  # Process 1 exits 1 on every attempt; process 0 would sleep 60 s and
  # ignores SIGTERM (as one blocked in a collective does).
  grace = 8.0
  result = _fails_as_told(max_restarts=1, grace_period=grace,
                          SURVIVOR_SLEEP='60', SURVIVOR_IGNORES_SIGTERM='1')
  assert result.exit_code == 1 and result.restart_count == 1, result.summary
  first, last = result.attempts
  # Attempt 0, a restart left: process 0 was stopped at once (SIGTERM, then
  # SIGKILL 0.5 s later), well within the grace period.
  assert first.first_failure == 1 and first.stopped == (0,), first.summary
  assert first.returncodes[0] == -signal.SIGKILL, first.summary
  assert first.end_times[0] - first.end_times[1] < 3.0, first.summary
  assert ('Processes [0] were stopped at once, to restart the job (restarts '
          'are left).') in first.summary
  # Attempt 1, none left: process 0 got the grace period.
  assert last.stopped == (0,), last.summary
  assert last.end_times[0] - last.end_times[1] >= grace, last.summary
  assert f'were stopped after the {grace:g} s grace period' in last.summary
  assert all(_gone(pid) for a in result.attempts for pid in a.pids)


def test_a_process_that_exits_78_ends_the_run_after_its_attempt():
  status = env_lib.NO_RETRY_EXIT_STATUS
  proc = _cli('--max_restarts=3', program='fails_as_told.py',
              env={'FAIL_STATUS': str(status)})
  assert proc.returncode == status, proc.stdout + proc.stderr
  assert 'attempt 0 cache' in proc.stdout and 'attempt 1' not in proc.stdout
  why = (f'not restarted: process 1 exited with status {status}, which says '
         'restarting will not help (bad flags, a missing or unusable '
         'checkpoint, settings the processes disagree on); fix what [p1] '
         'names and run again')
  assert (f'[launcher] attempt 0 failed: process 1 failed first (exit status '
          f'{status}); {why}.') in proc.stdout, proc.stdout
  assert 'multihost.launch: 1 attempt(s) (--max_restarts=3)' in proc.stderr
  assert (f'attempt 0 (MULTIHOST_RESTART_COUNT=0) at 0.0 s: process 1 failed '
          f'first (exit status {status}); {why}.') in proc.stderr, proc.stderr


def _caches(result: launch.LaunchResult) -> dict[tuple[int, int], str]:
  """{(attempt, process): the cache line's folder and whether it existed}."""
  found = {}
  for a in result.attempts:
    for out in a.outputs:
      for i, k, cache, exists in re.findall(
          r'process (\d) attempt (\d) cache (\S+) exists (\w+)', out):
        found[int(k), int(i)] = f'{cache} {exists}'
  return found


def test_every_attempt_gets_the_same_compilation_cache_folder(
    tmp_path, monkeypatch):
  monkeypatch.delenv(env_lib.COMPILATION_CACHE_DIR, raising=False)
  # With restarts: a fresh folder under the temp folder, the same for every
  # attempt and process, removed at the end.
  result = _fails_as_told(max_restarts=1, FAIL_UNTIL_ATTEMPT='0')
  assert result.ok and result.restart_count == 1, result.summary
  caches = _caches(result)
  assert sorted(caches) == [(0, 0), (0, 1), (1, 0), (1, 1)], result.outputs
  (line,) = set(caches.values())
  folder, exists = line.rsplit(' ', 1)
  folder = folder.strip("'")
  assert exists == 'True', line
  assert os.path.dirname(folder) == tempfile.gettempdir(), line
  assert os.path.basename(folder).startswith('multihost-jax-cache-'), line
  assert not os.path.exists(folder)
  # The user's $JAX_COMPILATION_CACHE_DIR is left as it is.
  mine = str(tmp_path / 'mine')
  result = _fails_as_told(max_restarts=1, FAIL_UNTIL_ATTEMPT='0',
                          JAX_COMPILATION_CACHE_DIR=mine)
  assert set(_caches(result).values()) == {f'{mine!r} False'}, result.outputs
  # --compilation_cache_dir: made, used by every attempt, kept.
  flag = str(tmp_path / 'flag')
  proc = _cli('--max_restarts=1', f'--compilation_cache_dir={flag}',
              program='fails_as_told.py', env={'FAIL_UNTIL_ATTEMPT': '0'})
  assert proc.returncode == 0, proc.stdout + proc.stderr
  for k in (0, 1):
    for i in (0, 1):
      assert (f'[p{i}] process {i} attempt {k} cache {flag!r} exists True\n'
              in proc.stdout), proc.stdout
  assert os.path.isdir(flag)
  # Without restarts, no folder is made.
  result = _fails_as_told(max_restarts=0, FAIL_UNTIL_ATTEMPT='-1')
  assert result.ok and set(_caches(result).values()) == {'None False'}


def test_an_exited_process_is_told_apart_before_it_is_reaped():
  # What keeps a process that died by itself, unreaped when the launcher
  # stops the others at once, from being counted as stopped by it.
  done = subprocess.Popen([PY, '-c', 'pass'])
  running = subprocess.Popen([PY, '-c', 'import time; time.sleep(30)'])
  try:
    stat = pathlib.Path(f'/proc/{done.pid}/stat')
    deadline = time.monotonic() + 30
    while stat.read_text().rsplit(')', 1)[1].split()[0] != 'Z':
      assert time.monotonic() < deadline, 'the child did not exit'
      time.sleep(0.02)
    assert _processes.exited(done.pid)
    assert stat.exists()  # Still a zombie: exited() did not reap it.
    assert done.wait(timeout=10) == 0
    assert _processes.exited(done.pid)  # Reaped.
    assert not _processes.exited(running.pid)
  finally:
    running.kill()
    running.wait(timeout=10)


def test_a_healed_failure_is_one_block_and_its_tracebacks_go_to_files(
    tmp_path):
  # Attempt 0: process 1 raises a chain of two exceptions; process 0 is
  # stopped and says so. Attempt 1 succeeds: neither shows on the screen.
  logs = tmp_path / 'logs'
  proc = _cli('--max_restarts=1', f'--log_dir={logs}',
              program='raises_on_first_attempt.py')
  out = proc.stdout
  assert proc.returncode == 0, out + proc.stderr
  assert 'Traceback' not in out and 'got SIGTERM' not in out, out
  assert ("[launcher] attempt 0 failed: process 1 failed first (exit status "
          "1), raised 'RuntimeError: step 3 failed'; restarting all 2 "
          "(restart 1 of 1).\n") in out, out
  assert re.search(r"\[launcher\]   at [\d.]+ s: p0 was running \(last line "
                   r"at [\d.]+ s: 'process 0 attempt 0'\)\.\n", out), out
  assert re.search(r'\[launcher\]   \d+ line\(s\) held back \(tracebacks, '
                   r"the stopped processes' last words\); every line of "
                   rf'attempt 0: {logs}/run-\d{{8}}-\d{{6}}-\w+/attempt-0\.p'
                   r'\*\.log\.\n', out), out
  assert 'process 0 attempt 1' in out and 'process 1 attempt 1' in out
  (logs,) = logs.iterdir()  # This run's folder.
  p1 = (logs / 'attempt-0.p1.log').read_text()
  assert p1.startswith('process 1 attempt 0\nTraceback'), p1
  assert 'ValueError: bad batch 7' in p1 and 'The above exception' in p1
  assert p1.rstrip().endswith('RuntimeError: step 3 failed'), p1
  assert 'got SIGTERM' in (logs / 'attempt-0.p0.log').read_text()
  assert not (logs / 'attempt-1.p0.log').exists()
  assert len(out.splitlines()) == 7, out


def test_a_failure_that_ends_the_run_shows_its_traceback_once(tmp_path):
  proc = _cli('--max_restarts=1', f'--log_dir={tmp_path}',
              program='raises_on_first_attempt.py',
              env={'RAISE_EVERY_ATTEMPT': '1'})
  out = proc.stdout
  assert proc.returncode == 1, out + proc.stderr
  # Attempt 0's in its files; the last attempt's on the screen, once.
  assert out.count('[p1] Traceback (most recent call last):\n') == 2, out
  assert out.count('[p1] RuntimeError: step 3 failed\n') == 1, out
  assert out.count('[p1] ValueError: bad batch 7\n') == 1, out
  assert out.index('process 1 attempt 1') < out.index('Traceback'), out
  assert 'held back' in out
  (first,) = tmp_path.glob('run-*/attempt-0.p1.log')
  # --verbosity=1: every line live, attempt 0's too; its files beside the
  # first run's (the same --log_dir), which stay as they were.
  kept = first.read_text()
  proc = _cli('--max_restarts=1', '--verbosity=1', f'--log_dir={tmp_path}',
              program='raises_on_first_attempt.py')
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert proc.stdout.count('[p1] RuntimeError: step 3 failed\n') == 1
  assert (proc.stdout.index('[p1] Traceback') <
          proc.stdout.index('[launcher] attempt 0 failed')), proc.stdout
  assert 'held back' not in proc.stdout
  logs = sorted(tmp_path.glob('run-*/attempt-0.p1.log'))
  assert len(logs) == 2 and first in logs, logs
  assert first.read_text() == kept


def test_a_traceback_no_failure_follows_is_streamed_after_a_while(
    monkeypatch):
  # A program that logs an exception and goes on: its traceback is held
  # (a restart would follow a failure), then streamed when none came.
  monkeypatch.setattr(_output, 'HELD_TRACEBACK_S', 1.0)
  stream = io.StringIO()
  code = ('import time, traceback\n'
          'try:\n  raise KeyError("cache miss")\n'
          'except KeyError:\n  traceback.print_exc()\n'
          'print("after the traceback", flush=True)\n'
          'time.sleep(4)\nprint("still going", flush=True)\n')
  result = launch.launch([PY, '-u', '-c', code], num_processes=1,
                         max_restarts=1, stream=stream, timeout=60)
  assert result.ok, result.summary
  out = stream.getvalue()
  assert out.count("[p0] KeyError: 'cache miss'\n") == 1, out
  assert (out.index('KeyError') < out.index('after the traceback') <
          out.index('still going')), out
