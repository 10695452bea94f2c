"""Tests of the multihost.testing pytest plugin, on generated test files.

Each test runs a real pytest in a subprocess (pytester), which launches real
worker controllers; there are few of them because every launch costs seconds.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from multihost import env as env_lib

pytest_plugins = ['pytester']

GROUPED_TESTS = '''
import os
import jax
import pytest

from multihost import env as env_lib
import multihost

two_by_two = pytest.mark.multihost(num_processes=2, devices_per_process=2)


@pytest.fixture(scope='module')
def parent_module_fixture():
  yield 'set up in the parent'


def test_unmarked_first(parent_module_fixture):
  assert parent_module_fixture == 'set up in the parent'


@two_by_two
def test_runs_on_every_process():
  assert (jax.process_count(), jax.device_count(),
          jax.local_device_count()) == (2, 4, 2)
  assert multihost.allgather_object(jax.process_index()) == [0, 1]


@two_by_two
def test_fails_on_process_1():
  print('output of process', jax.process_index())
  assert jax.process_index() == 0, 'only process 1 fails'


@two_by_two
def test_process_1_skips_a_collective():
  if jax.process_index() == 1:
    raise ValueError('process 1 gives up before the collective')
  multihost.allgather_object('lonely', timeout=2)


@two_by_two
def test_collectives_still_match_afterwards():
  assert multihost.allgather_object(jax.process_index() * 10) == [0, 10]


@two_by_two
def test_shared_folder(multihost_tmp_path):
  (multihost_tmp_path / str(jax.process_index())).write_text(str(os.getpid()))
  multihost.sync_global_devices('files written')
  assert sorted(p.name for p in multihost_tmp_path.iterdir()) == ['0', '1']
'''

# Runs after test_grouped.py, whose last test is marked: the parent must
# have ended test_grouped.py's module fixture as pytest would.
OTHER_MODULE = '''
def test_in_another_module():
  pass


def test_unmarked_runs_in_the_parent(request):
  import jax
  assert not jax.distributed.is_initialized()
  plugin = request.config.pluginmanager.get_plugin('multihost-parent')
  assert plugin.launches == 1  # All five marked tests: one launch.
'''

BROKEN_TESTS = '''
import os
import pathlib
import time
import jax
import pytest

from multihost import env as env_lib
import multihost

group = pytest.mark.multihost(num_processes=2, timeout=60)
PIDS = pathlib.Path(os.environ['PIDS_DIR'])


@group
def test_process_1_crashes():
  (PIDS / f'crash-{jax.process_index()}').write_text(str(os.getpid()))
  if jax.process_index() == 1:
    print('process 1 is about to crash', flush=True)
    os._exit(7)
  multihost.sync_global_devices('process 1 never comes')


@group
def test_after_the_crash():
  pass


@pytest.mark.multihost(num_processes=2, timeout=25)
def test_hangs():
  (PIDS / f'hang-{jax.process_index()}').write_text(str(os.getpid()))
  time.sleep(600)  # Past the timeout however much the load stretches it.
'''


def _gone(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  stat = pathlib.Path(f'/proc/{pid}/stat')
  try:
    return stat.read_text().rsplit(')', 1)[1].split()[0] in ('Z', 'X')
  except OSError:
    return True


def test_marked_tests_run_grouped_and_crashes_and_hangs_fail_their_groups(
    pytester, tmp_path, monkeypatch):
  """One pytest run of both kinds (a run of its own costs a JAX start).

  test_zzz_broken.py runs last, after test_zz_other.py has counted the
  launches of test_grouped.py.
  """
  monkeypatch.setenv('PIDS_DIR', str(tmp_path))
  # Unscaled by the load: test_hangs then waits out 25 s, not up to 4x
  # that (tests/unit/test_testing_merge.py covers the scaling).
  monkeypatch.setenv(env_lib.PYTEST_TIMEOUT_SCALE, '1')
  pytester.makepyfile(test_grouped=GROUPED_TESTS,
                      test_zz_other=OTHER_MODULE,
                      test_zzz_broken=BROKEN_TESTS)
  # --tb=short: the parent's --tb applies in the workers (checked below).
  result = pytester.runpytest_subprocess('-p', 'no:cacheprovider', '-rA',
                                         '--tb=short', timeout=240)
  # Grouped: 6 passed, 2 failed; broken: 2 failed, 1 error.
  result.assert_outcomes(passed=6, failed=4, errors=1)
  out = result.stdout.str()
  for name in ('test_runs_on_every_process', 'test_shared_folder',
               'test_collectives_still_match_afterwards'):
    assert f'PASSED test_grouped.py::{name}' in out
  assert 'PASSED test_zz_other.py::test_unmarked_runs_in_the_parent' in out
  assert 'PASSED test_zz_other.py::test_in_another_module' in out
  # The failing process is named; its traceback and both outputs are shown.
  result.stdout.fnmatch_lines([
      '*_ test_fails_on_process_1 _*',
      'multihost: call failed on process(es) [1] of 2 '
      '(devices_per_process=2).',
      '*= process 1 =*',
      "[[]p1[]] E * AssertionError: only process 1 fails",
  ])
  assert '[p0] output of process 0' in out
  assert '[p1] output of process 1' in out
  # Reports travel with pytest's serialization hooks: pytest's short
  # traceback style, and the crash line in the summary.
  result.stdout.fnmatch_lines([
      '[[]p1[]] test_grouped.py:*: in test_fails_on_process_1',
      '[[]p1[]] E   AssertionError: only process 1 fails',
  ])
  # (The summary line is cut at the terminal's width.)
  result.stdout.fnmatch_lines([
      'FAILED test_grouped.py::test_fails_on_process_1 - [[]p1[]] '
      'AssertionError: only p*',
  ])
  # Process 0 timed out in the collective that process 1 skipped; both fail.
  result.stdout.fnmatch_lines([
      '*_ test_process_1_skips_a_collective _*',
      'multihost: call failed on process(es) [[]0, 1[]] of 2 *',
  ])
  assert 'CollectiveTimeoutError: [process=0] allgather_object' in out
  assert 'ValueError: process 1 gives up before the collective' in out
  # Crashes and hangs fail their groups and leave nothing running.
  result.stdout.fnmatch_lines([
      '*_ test_process_1_crashes _*',
      'multihost: this test did not complete on processes [[]0, 1[]] of 2: '
      'the workers stopped early: process 1 ended first, exit status 7.',
  ])
  assert '[p1] process 1 is about to crash' in out
  result.stdout.fnmatch_lines([
      '*_ ERROR at setup of test_after_the_crash _*',
      '*It never started*',
  ])
  result.stdout.fnmatch_lines([
      '*_ test_hangs _*',
      '*hit its timeout of 25 s*and was stopped*',
  ])
  pids = [int(p.read_text()) for p in tmp_path.iterdir()]
  assert len(pids) == 4, sorted(p.name for p in tmp_path.iterdir())
  assert all(_gone(pid) for pid in pids)


SLEEPING_TEST = '''
import os
import pathlib
import time
import jax
import pytest

from multihost import env as env_lib


@pytest.mark.multihost(num_processes=2, timeout=120)
def test_sleeps():
  pids = pathlib.Path(os.environ['PIDS_DIR'])
  (pids / str(jax.process_index())).write_text(
      f"{os.getpid()} {os.environ['MULTIHOST_PYTEST_WORKER']}")
  time.sleep(100)
'''


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGKILL])
def test_killing_the_parent_pytest_leaves_no_worker(pytester, tmp_path, sig):
  """SIGTERM (e.g. from `timeout`): the parent stops the workers itself.

  SIGKILL: the workers notice that their parent is gone and exit.
  """
  pytester.makepyfile(test_sleeping=SLEEPING_TEST)
  env = dict(os.environ, PIDS_DIR=str(tmp_path))
  parent = subprocess.Popen(
      [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider'],
      cwd=pytester.path, env=env, stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL)
  try:
    deadline = time.monotonic() + 60
    written = []
    while time.monotonic() < deadline:
      # (A worker's file may be listed before its two fields are in it.)
      written = [p.read_text().split() for p in tmp_path.iterdir()]
      if len(written) == 2 and all(len(w) == 2 for w in written):
        break
      time.sleep(0.1)
    assert len(written) == 2 and all(len(w) == 2 for w in written), written
    workers = [int(pid) for pid, _ in written]
    results_dir = pathlib.Path(written[0][1])
    parent.send_signal(sig)
    assert parent.wait(timeout=30) == -sig
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in workers) and time.monotonic() < deadline:
      time.sleep(0.1)
    assert all(_gone(p) for p in workers), workers
    assert not results_dir.exists()  # Removed by the parent or the workers.
  finally:
    if parent.poll() is None:
      parent.kill()
      parent.wait()
