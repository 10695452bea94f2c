"""Attacks and faults, tried for real: port scans, impersonation, forged frames."""

from __future__ import annotations

import ast
import subprocess
import sys

from _helpers import clean_env
from _helpers import kill_alive
from _helpers import mode_parts
from _helpers import program
from _helpers import read_pids
from _helpers import stop
from _helpers import wait_gone
import pytest

from multihost import env as env_lib
from multihost import launch


def _run(mode):
  """tests/programs/attacks.py in MODE at 3 processes (see its docstring)."""
  # The attacks are on the TCP port and the links through it (a proxy):
  # local links off, or processes on this one host would bypass both.
  env = {env_lib.TIMEOUT: '30', env_lib.LOCAL_LINKS: '0'}
  if mode == 'truncate':
    # It outwaits the failure detection: shorter than the default 10 s, but
    # not so short that a stall of the loaded machine (all three processes
    # missing beats at once) ends the run: 3 s did once under two workers.
    env[env_lib.HEARTBEAT] = '8'
  result = launch.launch(program('attacks', mode), num_processes=3,
                         devices_per_process=1, timeout=120, env=env)
  return result, result.outputs


def test_port_scan_and_impostors_are_refused_and_collectives_stay_prompt():
  result, outs = _run('attack')
  assert result.ok, result.summary + '\n'.join(outs)
  assert 'ATTACKS REFUSED' in outs[1], outs[1]
  assert 'REPLAY REFUSED' in outs[2], outs[2]
  assert all('GATHER OK' in out for out in outs), outs


# A frame header is (call id, byte count, frame number, MAC). The receiver
# checks the three fields against what it expects, so a flipped field is
# also out of step; only a flipped MAC byte leaves the header consistent,
# and is refused by the MAC comparison alone. With the call id flipped, the
# message shows that the MAC is checked first (before any field is read).
@pytest.mark.parametrize('mode', ['flip-mac', 'flip'])
def test_a_flipped_frame_header_raises_and_delivers_nothing(mode):
  result, outs = _run(mode)
  assert result.ok, result.summary + '\n'.join(outs)
  assert 'DELIVERED CORRECT' not in outs[0], outs[0]
  assert 'failed authentication' in outs[0], outs[0]
  assert 'process 2 itself is not known to have failed' in outs[0], outs[0]


def test_an_altered_object_payload_is_never_unpickled():
  result, outs = _run('flip-payload')
  assert result.ok, result.summary + '\n'.join(outs)
  assert 'DELIVERED CORRECT' not in outs[0], outs[0]
  assert 'do not match the seal' in outs[0], outs[0]


def test_a_truncated_frame_raises_without_blaming_the_peer():
  result, outs = _run('truncate')
  assert result.ok, result.summary + '\n'.join(outs)
  assert 'DELIVERED CORRECT' not in outs[0], outs[0]
  assert 'no process is known to have failed' in outs[0], outs[0]
  assert 'process(es) [2] failed' not in outs[0], outs[0]


def test_a_replayed_frame_raises_and_delivers_nothing():
  result, outs = _run('replay')
  assert result.ok, result.summary + '\n'.join(outs)
  assert 'DELIVERED CORRECT' not in outs[0], outs[0]
  assert 'a replayed or reordered frame' in outs[0], outs[0]


# One run of tests/programs/tamper.py tries every mode in turn (each on a
# call of its own); a test reads its mode's part of every process's output.
_TAMPER_MODES = ('altered', 'resized', 'flagged', 'moved', 'planted')


@pytest.fixture(scope='module')
def _tampered(tmp_path_factory):
  """The outputs of the run of tamper.py at 2 processes (see its docstring)."""
  planted = tmp_path_factory.mktemp('tamper') / 'code-ran'
  result = launch.launch(program('tamper', ','.join(_TAMPER_MODES), planted),
                         num_processes=2, devices_per_process=1, timeout=120,
                         env={env_lib.TIMEOUT: '30'})
  return result, planted


def _tamper(tampered, mode):
  """Every process's output of MODE's attempt, after checking the run."""
  result, planted = tampered
  assert result.ok, result.summary + '\n'.join(result.outputs)
  assert not planted.exists(), 'the planted pickle ran'
  return mode_parts(result.outputs, mode)


def test_a_planted_key_is_refused_and_never_unpickled(_tampered):
  outs = _tamper(_tampered, 'planted')
  for out in outs:
    assert 'REFUSED' in out and 'is not the key of any process' in out, out


def test_an_altered_message_is_refused_and_never_unpickled(_tampered):
  outs = _tamper(_tampered, 'altered')
  for out in outs:
    assert 'REFUSED' in out and 'failed authentication' in out, out


# Altered so that the message's MAC tells first: its object's size field
# (its bytes cut to match, so it still decodes; the seal would refuse it
# later) or the flag byte of process 0's message changed (it still decodes,
# the object's seal checks), or its authentic message of the previous call
# put under this call's key.
@pytest.mark.parametrize('mode', ['resized', 'flagged', 'moved'])
def test_a_message_altered_consistently_is_refused(_tampered, mode):
  outs = _tamper(_tampered, mode)
  for out in outs:
    assert 'REFUSED' in out and 'failed authentication' in out, out


def test_a_controllers_orphaned_child_ends_with_the_run():
  result = launch.launch(program('orphan'), num_processes=1,
                         devices_per_process=1, timeout=60)
  pid = int(result.outputs[0].split('CHILD', 1)[1].split()[0])
  try:
    assert result.ok, result.summary
    assert wait_gone(pid, 5), f'the orphan {pid} still runs'
  finally:
    kill_alive([pid])


def test_a_killed_launcher_leaves_no_controller_running():
  launcher = subprocess.Popen(
      [sys.executable, '-m', 'multihost.launch', '--num_processes=2',
       '--devices_per_process=1', '--', *program('sleeper')],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  pids = []
  try:
    pids = read_pids(launcher.stdout, 'PID', 2, timeout=60)
    assert len(pids) == 2, pids
    launcher.kill()
    launcher.wait(10)
    for pid in pids:
      assert wait_gone(pid, 5), f'controller {pid} outlived its launcher'
  finally:
    stop(launcher)
    kill_alive(pids)


def test_initialize_binds_the_coordinator_to_its_own_host_only():
  out = subprocess.run(program('bind'), env=clean_env(), timeout=120,
                       capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-3000:]
  line = [l for l in out.stdout.splitlines() if l.startswith('LISTENING')][0]
  # 127.0.0.1 (or ::ffff:127.0.0.1) as /proc/net/tcp* write it; never
  # 0.0.0.0 or [::].
  listening = ast.literal_eval(line.split(' ', 1)[1])
  loopback = {'0100007F', '0000000000000000FFFF00000100007F'}
  assert listening and set(listening) <= loopback, line


def test_a_readable_secret_file_is_refused(tmp_path):
  secret = tmp_path / 'secret'
  secret.write_text('0123456789abcdef' * 4)  # 64 bytes: long enough
  secret.chmod(0o644)
  # The two runs differ only in the file's mode.
  env = {env_lib.JOB_SECRET_FILE: str(secret), env_lib.TIMEOUT: '20'}
  result = launch.launch(program('bulk_broadcast'), num_processes=2,
                         devices_per_process=1, timeout=120, env=env)
  assert 'REFUSED:' in result.outputs[0], result.outputs[0][-3000:]
  assert f'chmod 600 {secret}' in result.outputs[0], result.outputs[0]
  secret.chmod(0o600)
  result = launch.launch(program('bulk_broadcast'), num_processes=2,
                         devices_per_process=1, timeout=120, env=env)
  assert result.ok and not any('REFUSED' in o for o in result.outputs), (
      result.summary + '\n'.join(result.outputs))


def test_strangers_trickling_handshakes_do_not_stop_the_data_plane():
  """The issue's attack: 40 trickling sockets per port, after a broadcast."""
  result = launch.launch(program('trickle'), num_processes=3,
                         devices_per_process=1, timeout=180,
                         env={env_lib.TIMEOUT: '30',
                              env_lib.LOCAL_LINKS: '0'})  # (TCP's ports)
  assert result.ok, result.summary + '\n'.join(result.outputs)
  assert all('GATHERS OK' in out for out in result.outputs), result.outputs
  opened = int(result.outputs[1].split('OPENED ', 1)[1].split()[0])
  assert opened >= 3 * 40, opened


def test_a_controllers_child_does_not_inherit_the_job_secret():
  result = launch.launch(program('child_env'), num_processes=2,
                         devices_per_process=1, timeout=120,
                         env={env_lib.TIMEOUT: '30'})
  assert result.ok, result.summary + '\n'.join(result.outputs)
  for out in result.outputs:
    assert 'CHILD SEES SECRET no' in out, out
    assert 'GATHERED [0, 1]' in out, out
