"""Tests of multihost.launch: real processes, real signals, real JAX runs."""

from __future__ import annotations

import errno
import io
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

from _helpers import alive
from _helpers import program
from _helpers import read_pids
from _helpers import stop
import pytest

from multihost import launch
from multihost import lowlevel

ROOT = pathlib.Path(__file__).resolve().parents[2]
SEED_NAME = '000_ceec6835a23a2fd6.txt'
# The course workspace keeps the seeds in shared/seeds beside the checkout
# (/work/main -> /work/shared) or beside a worktree's parent (/work/wt/x).
SEED = next((d / 'shared' / 'seeds' / SEED_NAME for d in ROOT.parents
             if (d / 'shared' / 'seeds').is_dir()),
            ROOT.parent / 'shared' / 'seeds' / SEED_NAME)
PY = sys.executable


def _bind_fails(port: int) -> bool:
  with socket.socket() as s:
    try:
      s.bind(('127.0.0.1', port))
    except OSError as e:
      assert e.errno == errno.EADDRINUSE, e
      return True
  return False


def test_a_held_port_is_kept_from_other_binds_and_open_to_the_service():
  """`hold_free_port`: no other bind gets the port while it is held (so no other launch's find_free_port), yet JAX's service binds it; the launcher holds its port from before the controllers start."""
  hold = launch.hold_free_port()
  port = hold.getsockname()[1]
  try:
    assert _bind_fails(port)
    service = lowlevel.start_service(f'127.0.0.1:{port}', 1,
                                     heartbeat_timeout=5, shutdown_timeout=1)
    service.shutdown()
  finally:
    hold.close()
  assert not _bind_fails(port)
  # Controllers that never start a service: only the hold keeps the port.
  with launch.Controllers([sys.executable, '-c', 'import time; '
                           'time.sleep(60)'], num_processes=2,
                          kill_wait=1) as cluster:
    assert _bind_fails(cluster.port)
  assert not _bind_fails(cluster.port)


def test_child_env_lets_jax_detect_the_cluster():
  """JAX's Open MPI detection finds the coordinator, size and rank we set."""
  from jax._src.clusters import ompi_cluster  # Checked, not used by launch.

  env = launch.child_env(1, num_processes=3, devices_per_process=2, port=4321,
                         base={})
  old = dict(os.environ)
  try:
    os.environ.clear()
    os.environ.update(env)
    cluster = ompi_cluster.OmpiCluster
    assert cluster.is_env_present()
    port_override = os.environ['JAX_COORDINATOR_PORT']
    assert cluster.get_coordinator_address(None, port_override) == (
        '127.0.0.1:4321')
    assert (cluster.get_process_count(), cluster.get_process_id()) == (3, 1)
  finally:
    os.environ.clear()
    os.environ.update(old)
  assert env['JAX_COORDINATOR_ADDRESS'] == '127.0.0.1:4321'
  assert env['JAX_COORDINATOR_BIND_ADDRESS'] == '127.0.0.1:4321'
  assert (env['JAX_NUM_PROCESSES'], env['JAX_PROCESS_ID'],
          env['JAX_NUM_CPU_DEVICES'], env['JAX_PLATFORMS']) == (
              '3', '1', '2', 'cpu')


def test_bare_jax_distributed_initialize_2x2_with_prefixed_output():
  stream = io.StringIO()
  result = launch.launch(program('bare_jax_facts'), num_processes=2,
                         devices_per_process=2, timeout=60, stream=stream)
  assert result.ok, result.summary + '\n' + '\n'.join(result.outputs)
  assert result.returncodes == (0, 0)
  streamed = stream.getvalue().splitlines()
  for i in range(2):
    assert f'facts {i} 2 2 4 [0, 1]\n' in result.outputs[i]
    # Every streamed line carries its process's prefix, ours whole at its end.
    assert any(line.startswith(f'[p{i}] ')
               and line.endswith(f'facts {i} 2 2 4 [0, 1]')
               for line in streamed), streamed
    assert any(line.startswith(f'[p{i}] ') and line.endswith('second line')
               for line in streamed), streamed
  assert all(re.match(r'\[p[01]\] ', line) for line in streamed), streamed
  assert 'exit status 0' in result.summary
  assert not any(alive(pid) for pid in result.pids)


@pytest.mark.parametrize('how, rc, status, text', [
    ('exit3', 3, 3, 'exit status 3'),
    ('segv', -signal.SIGSEGV, 128 + signal.SIGSEGV, 'killed by SIGSEGV'),
])
def test_first_failure_stops_the_others_after_the_grace_period(
    how, rc, status, text):
  start = time.monotonic()
  result = launch.launch(program('one_fails', how), num_processes=3,
                         grace_period=0.5, kill_wait=0.5, timeout=30)
  took = time.monotonic() - start
  assert result.first_failure == 1
  assert result.returncodes[1] == rc
  assert result.exit_code == status
  assert result.stopped == (0, 2)
  assert result.returncodes[0] == result.returncodes[2] == -signal.SIGKILL
  assert f'First failure: process 1 ({text}' in result.summary
  assert 'were stopped after the 0.5 s grace period' in result.summary
  assert not result.timed_out
  assert took < 10, took
  assert not any(alive(pid) for pid in result.pids)


def test_timeout_stops_everything_and_names_who_was_running():
  result = launch.launch(program('only_0_exits'), num_processes=3, timeout=1.0,
                         kill_wait=0.5)
  assert result.timed_out
  assert result.exit_code == launch.TIMEOUT_EXIT_STATUS == 124
  assert result.still_running_at_timeout == (1, 2)
  assert result.first_failure is None
  assert 'processes [1, 2] were still running' in result.summary
  assert not any(alive(pid) for pid in result.pids)


def test_coordinator_death_is_blamed_on_process_0_not_the_survivors():
  # Process 0 hosts the service itself (its companion opted out).
  with launch.Controllers(program('barrier_without_0'), num_processes=3,
                          grace_period=5,
                          env={**os.environ,
                               'MULTIHOST_COMPANION_SERVICE': '0'}) as cluster:
    pids = cluster.pids
    for i in range(3):
      assert cluster.wait_for_output(i, 'ready', timeout=60), cluster.outputs
    time.sleep(0.3)  # Let the others enter the barrier.
    cluster.kill(0, signal.SIGKILL)
    result = cluster.wait(timeout=60)
  assert result.first_failure == 0
  assert result.returncodes[0] == -signal.SIGKILL
  assert result.exit_code == 128 + signal.SIGKILL
  # JAX's runtime aborts the survivors on its own, within the grace period.
  assert result.returncodes[1:] == (-signal.SIGABRT, -signal.SIGABRT), (
      result.summary)
  assert result.stopped == ()
  assert ('Process 0, which hosts the JAX coordination service, died first: '
          'killed by SIGKILL') in result.summary
  assert 'aborted the other processes [1, 2] (SIGABRT)' in result.summary
  assert 'they are not the cause' in result.summary
  assert not any(alive(pid) for pid in pids)


@pytest.mark.parametrize('entry', [
    ['-m', 'multihost.launch'], [str(ROOT / 'bin' / 'launch.py')]])
def test_command_line_prefixes_streams_and_propagates_status(entry):
  proc = subprocess.run(
      [PY, *entry, '--num_processes=2', '--grace_period=1', '--',
       *program('hello_exit')], capture_output=True, text=True, timeout=60,
      cwd=ROOT)
  assert proc.returncode == 5, proc.stderr
  assert '[p0] hello from 0\n' in proc.stdout
  assert '[p1] hello from 1\n' in proc.stdout
  assert 'First failure: process 1 (exit status 5)' in proc.stderr


def test_sigint_to_the_launcher_is_forwarded_and_nothing_survives():
  # Process 1 ignores SIGINT, so the launcher must follow up with SIGKILL.
  proc = subprocess.Popen(
      [PY, '-m', 'multihost.launch', '--num_processes=2', '--grace_period=60',
       '--', *program('sigint_ignorer')],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, cwd=ROOT)
  try:
    pids = read_pids(proc.stdout, ' pid ', 2, timeout=30)
    assert len(pids) == 2
    proc.send_signal(signal.SIGINT)
    time.sleep(1)
    # Process 1 ignores it; a second Ctrl-C ends the 60 s grace at once.
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
  finally:
    stop(proc)
  assert proc.returncode == 128 + signal.SIGINT, err
  assert 'Interrupted by SIGINT' in err
  assert 'killed by SIGKILL' in err  # Process 1 ignored the SIGINT.
  assert not any(alive(pid) for pid in pids)


def test_tutorial_runs_unchanged_under_the_launcher(tmp_path):
  # The seeds live beside the checkout (shared/seeds), not in it: a plain
  # clone elsewhere has no such directory, and that alone is a reason to
  # skip. Where the directory exists, a missing seed is a broken setup.
  if not SEED.parent.is_dir():
    pytest.skip(f'no shared/seeds directory in any parent of {ROOT} (a '
                'clone outside the course workspace); the tutorial is not '
                'available to run')
  assert SEED.exists(), (
      f'the tutorial seed {SEED.name} is missing from {SEED.parent} (found: '
      f'{sorted(p.name for p in SEED.parent.iterdir())}); restore it')
  script = tmp_path / 'tutorial.py'
  # The seed is a title line followed by a Python script.
  script.write_text(SEED.read_text().split('\n', 1)[1])
  checkpoints = tmp_path / 'checkpoints'
  checkpoints.mkdir()
  result = launch.launch(
      [PY, str(script)], num_processes=2, devices_per_process=2, timeout=120,
      env={'COURSE_MULTIPROCESS': '1',
           'COURSE_CHECKPOINT_DIR': str(checkpoints)},
      cwd=tmp_path)
  assert result.ok, result.summary + '\n' + result.outputs[0][-3000:]
  for out in result.outputs:
    assert 'Recorded backend/processes/devices: cpu 2 4' in out
  assert (checkpoints / 'step-one').is_dir()


def test_host_service_turns_process_0_death_into_an_ordinary_failure():
  with launch.Controllers(program('process_0_dies'), num_processes=3,
                          grace_period=30, host_service=True,
                          heartbeat_timeout=3) as cluster:
    result = cluster.wait(timeout=90)
  assert result.returncodes[0] == -signal.SIGKILL, result.summary
  for i in (1, 2):
    assert 'RAISED (0,)' in result.outputs[i], result.outputs[i][-2000:]
    assert result.returncodes[i] == 3, result.summary
  assert 'hosts the JAX coordination service' not in result.summary
  assert not any(alive(pid) for pid in result.pids)
