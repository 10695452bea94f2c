"""The launcher and the pytest plugin on simulated hosts (hosts='netns'): placement, the coordinator's address, teardown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from _helpers import program
from _helpers import stop
import numpy as np
import pytest

import multihost
from multihost import launch
from multihost import netns

_OK, _WHY = netns.available()
_needs_hosts = pytest.mark.skipif(not _OK, reason=_WHY or 'no simulated hosts')

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def _namespaces_of(pid: int) -> list[str]:
  out = subprocess.run(['ip', 'netns', 'list'], capture_output=True,
                       text=True, timeout=30).stdout
  return [l for l in out.splitlines() if l.startswith(f'{netns.PREFIX}{pid}-')]


def _env():
  return {'PYTHONPATH': _ROOT}


@_needs_hosts
def test_controllers_run_on_hosts_of_their_own_with_the_coordinator_on_host_0():
  with launch.Controllers(program('placed'), num_processes=2, env=_env(),
                          hosts='netns') as cluster:
    net = cluster.hosts
    addresses = [net.address(i) for i in range(2)]
    result = cluster.wait(120)
  assert result.exit_code == 0, result.summary + '\n'.join(result.outputs)
  for i in range(2):
    where = result.outputs[i].split('WHERE ', 1)[1].split()
    assert where[0] == addresses[i]
    assert where[1].rsplit(':', 1)[0] == addresses[0]
  assert addresses[0] != addresses[1]
  assert _namespaces_of(os.getpid()) == []


@_needs_hosts
def test_hosts_are_deleted_when_the_body_raises_and_on_timeout():
  with pytest.raises(KeyError):
    with launch.Controllers(program('placed', 0, 'plain'), num_processes=2,
                            env=_env(), hosts='netns') as cluster:
      assert len(_namespaces_of(os.getpid())) == 3  # 2 hosts and the switch.
      raise KeyError('boom')
  assert _namespaces_of(os.getpid()) == []
  cluster = launch.Controllers(program('placed', 600, 'plain'),
                               num_processes=2, env=_env(), hosts='netns',
                               kill_wait=1)
  result = cluster.wait(10)
  assert result.timed_out
  assert _namespaces_of(os.getpid()) == []


@_needs_hosts
@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGKILL])
def test_the_cli_places_controllers_and_cleans_up_after_ctrl_c(sig):
  proc = subprocess.Popen(
      [sys.executable, '-m', 'multihost.launch', '--num_processes=2',
       '--hosts=netns', '--timeout=120', '--',
       *program('placed', 600, 'plain')],
      env={**os.environ, **_env()}, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    seen = []
    for line in proc.stdout:
      seen.append(line)
      if sum('WHERE' in l for l in seen) == 2:
        break
    where = sorted(l.split('WHERE ', 1)[1].split()[0] for l in seen
                   if 'WHERE' in l)
    assert len(set(where)) == 2 and not where[0].startswith('127.'), seen
    assert len(_namespaces_of(proc.pid)) == 3
    os.kill(proc.pid, sig)
    proc.wait(timeout=60)
  finally:
    stop(proc)
    proc.stdout.close()
  if sig == signal.SIGKILL:  # Nothing of ours ran: the next run deletes them.
    assert len(_namespaces_of(proc.pid)) == 3
    netns.cleanup_stale()
  assert _namespaces_of(proc.pid) == []


def test_hosts_netns_where_it_cannot_work_says_why():
  with pytest.raises(ValueError, match="hosts must be None or 'netns'"):
    launch.Controllers(['true'], num_processes=2, hosts='docker')
  if _OK:
    with pytest.raises(ValueError, match='host_service'):
      launch.Controllers(['true'], num_processes=2, hosts='netns',
                         host_service=True)
  else:
    with pytest.raises(netns.HostsError, match=_WHY.split(';')[0][:30]):
      launch.Controllers(['true'], num_processes=2, hosts='netns')


@pytest.mark.multihost(num_processes=2, hosts='netns', timeout=120)
def test_marked_tests_run_on_hosts_of_their_own():
  me = socket.gethostname()
  names = multihost.process_allgather(
      np.frombuffer(me.encode().ljust(16), dtype=np.uint8))
  names = [bytes(n).decode().strip() for n in np.asarray(names)]
  assert len(set(names)) == 2
  assert all(socket.inet_aton(n) and not n.startswith('127.') for n in names)


def test_the_summary_says_which_process_lost_the_coordination_service():
  lost = ('F1130 client.cc:1] ' + launch.LOST_SERVICE_MARKER +
          ': Heartbeat timeout\n')
  run = launch.Observed(
      returncodes=(3, -signal.SIGABRT, -signal.SIGABRT), end_times=(9.0, 4.0, 4.5),
      stopped=frozenset(), pids=(10, 11, 12),
      outputs=('ProcessFailureError\n', lost, 'aborted without the line\n'),
      devices_per_process=1, elapsed=10.0, grace_period=30.0,
      host_service=False, timed_out=False, still_running_at_timeout=(),
      interrupted_by=None)
  assert launch.lost_coordinator(run.returncodes, run.outputs) == [1]
  summary = launch.report(run).summary
  assert ('Process 1 lost the coordination service (network partition or '
          'coordinator gone)') in summary, summary
  assert 'Process 2 lost' not in summary and 'Process 0 lost' not in summary


@pytest.mark.multihost(num_processes=2, hosts='netns', timeout=120)
def test_checkpoints_in_a_folder_the_hosts_do_not_share_say_so(
    tmp_path, multihost_tmp_path):
  import recovery  # pylint: disable=g-import-not-at-top
  # tmp_path is a different folder on each process: like a local disk.
  with pytest.raises(recovery.CheckpointError,
                     match=r'is not shared: process\(es\) \[1\] do not see'):
    recovery.Checkpoints(tmp_path / 'ckpt')
  with recovery.Checkpoints(multihost_tmp_path / 'ckpt'):
    pass
  assert not [n for n in os.listdir(multihost_tmp_path / 'ckpt')
              if n.startswith('.shared-folder-probe')]
