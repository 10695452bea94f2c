"""The local tier across simulated hosts with disks of their own (netns + mount namespaces).

Each controller runs on a host of its own (`--hosts=netns`: a network
namespace, its hostname its address) and sees its own local folder at the
same path (`SimulatedHosts(private_folder=...)`, a bind mount in a mount
namespace per host, set here through $MULTIHOST_NETNS_PRIVATE_FOLDER as a
user of `python -m multihost.launch` would). The drills run `bin/train.py`
as 2 controllers x 2 devices under `--max_restarts=1`; process 1 deletes its
host's local folder (a replaced host) and SIGKILLs itself mid-run. The
restarted run must resume from the local tier, refill host 1 from host 0,
and end bitwise equal to an uninterrupted run on the same hosts.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import _helpers
import pytest

from multihost import launch
from multihost import netns
import recovery
from recovery._src.local import folder
from recovery._src.local import private

_OK, _WHY = netns.available()
_needs_hosts = pytest.mark.skipif(not _OK, reason=_WHY or 'no simulated hosts')

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / 'bin' / 'train.py')
PY = sys.executable
K = 5
STEPS = 30
KILL_AFTER = 17


def _namespaces_of(pid: int) -> list[str]:
  out = subprocess.run(['ip', 'netns', 'list'], capture_output=True,
                       text=True, timeout=30).stdout
  return [line for line in out.splitlines()
          if line.startswith(f'{netns.PREFIX}{pid}-')]


def _mounted(path) -> bool:
  with open('/proc/self/mounts') as f:
    return any(line.split()[1] == str(path) for line in f)


@_needs_hosts
def test_each_host_sees_its_own_folder_at_the_same_path(tmp_path):
  common = tmp_path / 'local'
  with netns.SimulatedHosts(2, private_folder=common) as net:
    for i in range(2):
      subprocess.run(net.command(i, ['sh', '-c', f'hostname > {common}/me']),
                     check=True, timeout=30)
    seen = [pathlib.Path(net.host_folder(i), 'me').read_text().strip()
            for i in range(2)]
    assert seen == [net.address(0), net.address(1)]
  assert not any(common.iterdir())  # Written on the hosts' disks only.
  assert not _mounted(common)
  assert _namespaces_of(os.getpid()) == []
  with pytest.raises(ValueError, match='must be an absolute path'):
    netns.SimulatedHosts(2, private_folder='relative/local')


def _run(tmp_path, monkeypatch, *extra, kill=True):
  """bin/train.py at 2x2 on 2 netns hosts with local disks, --max_restarts=1."""
  local = tmp_path / 'local'
  monkeypatch.setenv(netns.PRIVATE_FOLDER_VARIABLE, str(local))
  monkeypatch.delenv(recovery.HOST_ID_VARIABLE, raising=False)
  args = [PY, TRAIN, f'--checkpoint_dir={tmp_path}/ckpt', f'--steps={STEPS}',
          '--save_every=50', f'--local_checkpoint_dir={local}',
          f'--local_save_every={K}', *extra]
  if kill:
    args += [f'--drill_kill_after_step={KILL_AFTER}', '--drill_wipe_local']
  result = launch.launch(args, num_processes=2, devices_per_process=2,
                         grace_period=1, kill_wait=0.5, timeout=240,
                         max_restarts=1, cwd=ROOT, hosts='netns',
                         env={'PYTHONPATH': str(ROOT),
                              **_helpers.quick_compile_env()})
  out = '\n'.join(o for a in result.attempts for o in a.outputs)
  assert result.ok, result.summary + '\n' + out[-4000:]
  (digest,) = re.findall(r'Finished step \d+ .*digest (\w+)', out)
  assert not _mounted(local)
  assert _namespaces_of(os.getpid()) == []
  assert not any(os.path.exists(f'/proc/{pid}') for a in result.attempts
                 for pid in a.pids)
  return result, out, digest, local


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  with pytest.MonkeyPatch.context() as mp:
    _, _, digest, _ = _run(tmp_path_factory.mktemp('reference'), mp,
                           kill=False)
  return digest


@_needs_hosts
@pytest.mark.parametrize('sharded', [False, True],
                         ids=['replicated', 'shard-params'])
def test_a_replaced_netns_host_restores_from_its_peer_bitwise_equal(
    tmp_path, monkeypatch, uninterrupted, sharded):
  extra = ['--shard_params'] if sharded else []
  result, out, digest, local = _run(tmp_path, monkeypatch, *extra)
  assert result.restart_count == 1
  assert digest == uninterrupted
  resumed = {int(p): (int(s), t, int(b)) for p, s, t, b in re.findall(
      r'\[process=(\d)\] Resumed from step (\d+) \(epoch \d+\) from the '
      r'(\w+) tier, (\d+) bytes from peers', out)}
  assert {p: r[:2] for p, r in resumed.items()} == {
      0: (15, 'local'), 1: (15, 'local')}, out[-3000:]
  assert KILL_AFTER - 15 <= 2 * K
  # Host 1's disk was wiped: all it needs came from host 0 (its own shards
  # as host 0's peer copies, with --shard_params), nothing went to host 0.
  assert resumed[0][2] == 0 and resumed[1][2] > 0, resumed
  print(f'netns drill ({"sharded" if sharded else "replicated"}): '
        f'{KILL_AFTER - 15} steps lost, {resumed[1][2]} bytes from peers')
  # Each host's disk holds only its own processes' folders and its own
  # identity (each host's differs); the common path itself stayed empty
  # (every write went to a host's disk).
  for i in range(2):
    disk = pathlib.Path(f'{local}.host{i}')
    assert sorted(p.name for p in disk.iterdir()) == [
        private.FOLDER_ID_FILE, f'process_{i}']
  assert len({private.folder_id(f'{local}.host{i}') for i in range(2)}) == 2
  assert not any(local.iterdir())
  newest = max(folder.scan(f'{local}.host1'), key=lambda s: s.step)
  assert newest.step == STEPS
  if sharded:  # Host 0's shards, copied to host 1 after the restart.
    assert newest.manifest['peer_keys'], newest.manifest
  else:  # Replicated: nothing is held by one host only.
    assert newest.manifest['peer_keys'] == []
