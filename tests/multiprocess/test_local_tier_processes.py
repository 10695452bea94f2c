"""The local checkpoint tier: atomic per-process steps, peer copies, restores.

Single-process tests (4 virtual devices) check the folder format, keep-N, the
choice between the tiers and the fallbacks. The drills run `bin/train.py` as
2 controllers x 2 devices under `multihost.launch --max_restarts=1`, each
controller on a simulated host of its own ($RECOVERY_HOST_ID and its own
local folder), and SIGKILL process 1 mid-run: the restarted run resumes from
the local tier, refilling a wiped host from its peer, and ends bitwise equal
to an uninterrupted run.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

import _helpers
import pytest

from multihost import launch
import recovery
from recovery._src.local import folder

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / 'bin' / 'train.py')
PY = sys.executable


# -- a small model, sharded or replicated over this process's 4 devices ------


# -- the folder format --------------------------------------------------------


# -- saving, keep-N and the choice of tier ------------------------------------


# -- drills: 2 controllers x 2 devices, SIGKILL, --max_restarts=1 -------------

K = 5
STEPS = 30
KILL_AFTER = 17


def _drill(tmp_path, *extra, kill=True, one_host=False):
  """bin/train.py under --max_restarts=1, on 2 simulated hosts or on one."""
  args = [f'--checkpoint_dir={tmp_path}/ckpt', f'--steps={STEPS}',
          '--save_every=50', f'--local_save_every={K}',
          f'--metrics_out={tmp_path}/metrics.jsonl', *extra]
  if kill:
    args.append(f'--drill_kill_after_step={KILL_AFTER}')
  if one_host:  # Both processes share the host's folder.
    command = (f'exec "{PY}" "{TRAIN}" --local_checkpoint_dir={tmp_path}/local '
               + ' '.join(args))
  else:
    command = ('exec env RECOVERY_HOST_ID=host$JAX_PROCESS_ID '
               f'"{PY}" "{TRAIN}" --local_checkpoint_dir={tmp_path}/local'
               '$JAX_PROCESS_ID ' + ' '.join(args))
  env = {**{k: v for k, v in os.environ.items()
            if k != recovery.HOST_ID_VARIABLE},
         **_helpers.quick_compile_env()}
  result = launch.launch(['sh', '-c', command], num_processes=2,
                         devices_per_process=2, grace_period=1,
                         kill_wait=0.5, timeout=120, max_restarts=1, cwd=ROOT,
                         env=env)
  assert result.ok, result.summary + '\n' + '\n'.join(
      o[-3000:] for o in result.outputs)
  out = '\n'.join(o for a in result.attempts for o in a.outputs)
  (digest,) = re.findall(r'Finished step \d+ .*digest (\w+)', out)
  return result, out, digest


def _resumed(out):
  """{process: (step, tier, bytes from peers, time)} of the resumed attempt."""
  return {int(p): (int(s), t, int(b), float(at)) for p, s, t, b, at in
          re.findall(r'\[process=(\d)\] Resumed from step (\d+) \(epoch \d+\) '
                     r'from the (\w+) tier, (\d+) bytes from peers, at '
                     r'(\d+\.\d+)', out)}


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  _, _, digest = _drill(tmp_path_factory.mktemp('reference'), kill=False)
  return digest


def test_sigkill_restarts_from_a_replaced_host_s_peer_bitwise_equal(
    tmp_path, uninterrupted):
  # Process 1 deletes its host's local folder, then SIGKILLs itself.
  result, out, digest = _drill(tmp_path, '--shard_params',
                               '--drill_wipe_local')
  assert result.restart_count == 1
  assert digest == uninterrupted
  resumed = _resumed(out)
  assert {p: r[:2] for p, r in resumed.items()} == {
      0: (15, 'local'), 1: (15, 'local')}, out[-3000:]
  assert KILL_AFTER - 15 <= 2 * K
  # Host 1's half of the weights and momentum (its peer copies on host 0)
  # and every replicated leaf came from host 0.
  peers = {p: r[2] for p, r in resumed.items()}
  assert peers[0] == 0 and peers[1] == 320, peers
  # Host 1's newest local step (written after the restart) holds its own
  # blocks and host 0's as a peer copy: host 0 is host 1's successor in the
  # ring, as host 1 is host 0's. 4 devices, 2 of the 8 weights each.
  newest = max(folder.scan(str(tmp_path / 'local1')),
               key=lambda s: s.step)
  blocks = {k[1] for k in newest.entries if k[0] == 'user/weights'}
  assert blocks == {((0, 2),), ((2, 4),), ((4, 6),), ((6, 8),)}, blocks
  assert sorted(map(str, newest.manifest['peer_keys'])) == sorted(
      str([leaf, [[a, a + 2]]]) for leaf in ('user/momentum', 'user/weights')
      for a in (0, 2))
  _report('replaced host', out, resumed, peers)
  assert not any(os.path.exists(f'/proc/{pid}') for a in result.attempts
                 for pid in a.pids)


def test_sigkill_restarts_two_processes_sharing_one_host_s_folder(
    tmp_path, uninterrupted):
  result, out, digest = _drill(tmp_path, '--shard_params', one_host=True)
  assert digest == uninterrupted
  resumed = _resumed(out)
  assert {p: r[:3] for p, r in resumed.items()} == {
      0: (15, 'local', 0), 1: (15, 'local', 0)}, out[-3000:]
  # One host: each process wrote its own shards in its own subfolder, the
  # replicated leaves were written once (by process 0), nothing was copied.
  stored = {(s.manifest['process'], s.step): s
            for s in folder.scan(str(tmp_path / 'local'))}
  assert {k[1] for k in stored} == {25, 30}
  one = stored[(1, 30)]
  assert set(one.entries) == {(leaf, ((a, a + 2),)) for a in (4, 6)
                              for leaf in ('user/weights', 'user/momentum')}
  assert one.manifest['peer_keys'] == []
  assert ('data/order', ()) in stored[(0, 30)].entries
  _report('one host', out, resumed, {0: 0, 1: 0})


def _report(what, out, resumed, peers):
  killed = float(re.search(r'SIGKILLs itself after step \d+ at (\d+\.\d+)',
                           out).group(1))
  # Restored on every process, about to train again.
  again = max(at for _, _, _, at in resumed.values())
  print(f'drill {what}: kill to training again {again - killed:.1f} s, '
        f'{KILL_AFTER - 15} steps lost, bytes from peers {peers}')


