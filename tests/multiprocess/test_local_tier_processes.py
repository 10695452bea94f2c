"""The local checkpoint tier: atomic per-process steps, peer copies, restores.

Single-process tests (4 virtual devices) check the folder format, keep-N, the
choice between the tiers and the fallbacks. The drills run `bin/train.py` as
2 controllers x 2 devices under `multihost.launch --max_restarts=1`, each
controller on a simulated host of its own ($RECOVERY_HOST_ID and its own
local folder, or the same hostname and a disk of its own at the same path in
a mount namespace of its own), and SIGKILL process 1 mid-run: the restarted
run resumes from the local tier, refilling a wiped host from its peer, and
ends bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import _helpers
import pytest

from multihost import env
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


def _own_disks_unavailable() -> str | None:
  """Why a mount namespace with a bind mount cannot be made here, or None."""
  if os.geteuid() != 0:
    return 'needs root for mount namespaces'
  if shutil.which('unshare') is None:
    return 'needs unshare(1) (util-linux) for mount namespaces'
  with tempfile.TemporaryDirectory() as where:
    probe = subprocess.run(
        ['unshare', '-m', '--propagation', 'private', 'sh', '-c',
         f'mount --bind "{where}" "{where}" && umount "{where}"'],
        capture_output=True, text=True, timeout=30, check=False)
  if probe.returncode != 0:
    return ('cannot mount in a mount namespace here (unshare -m: '
            f'{(probe.stderr or probe.stdout).strip()[:200]})')
  return None


def _drill(tmp_path, *extra, kill=True, one_host=False, own_disks=False,
           host_id='host$JAX_PROCESS_ID', save_every=50, extra_env=None):
  """bin/train.py under --max_restarts=1, on 2 simulated hosts or on one.

  `own_disks`: no $RECOVERY_HOST_ID and one hostname, but each process sees
  a disk of its own (tmp_path/disk<P>, which outlives the restart as a
  host's disk does) at the same path tmp_path/mnt, bind-mounted in a mount
  namespace of its own; the local folder is tmp_path/mnt/local.
  """
  args = [f'--checkpoint_dir={tmp_path}/ckpt', f'--steps={STEPS}',
          f'--save_every={save_every}', f'--local_save_every={K}',
          f'--metrics_out={tmp_path}/metrics.jsonl', *extra]
  if kill:
    args.append(f'--drill_kill_after_step={KILL_AFTER}')
  if own_disks:
    for p in ('mnt', 'disk0', 'disk1'):
      (tmp_path / p).mkdir(mode=0o700)
    mount = (f'mount --bind "{tmp_path}/disk$JAX_PROCESS_ID" "{tmp_path}/mnt"'
             f' && exec "{PY}" "{TRAIN}" '
             f'--local_checkpoint_dir="{tmp_path}/mnt/local" '
             + ' '.join(args))
    # unshare execs in place: the launcher's pid stays the trainer's, and
    # the namespace (with its mount) ends with the process.
    assert "'" not in mount, mount
    command = f"exec unshare -m --propagation private sh -c '{mount}'"
  elif one_host:  # Both processes share the host's folder.
    command = (f'exec "{PY}" "{TRAIN}" --local_checkpoint_dir={tmp_path}/local '
               + ' '.join(args))
  else:
    command = (f'exec env RECOVERY_HOST_ID={host_id} '
               f'"{PY}" "{TRAIN}" --local_checkpoint_dir={tmp_path}/local'
               '$JAX_PROCESS_ID ' + ' '.join(args))
  env = {**{k: v for k, v in os.environ.items()
            if k != recovery.HOST_ID_VARIABLE},
         **_helpers.quick_compile_env(), **(extra_env or {})}
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


def test_peer_copies_larger_than_the_object_limit_travel_out_of_band(tmp_path):
  # $MULTIHOST_MAX_OBJECT_BYTES=8192, and each host's blocks (half of the
  # weights and momentum at width 4096: 16 KiB) are more: every local save
  # and the restore from the peer still work (the arrays travel out of
  # band, outside the limit; the hosts' lists of steps, under it).
  _, _, reference = _drill(tmp_path / 'reference', '--shard_params',
                           '--width=4096', kill=False)
  result, out, digest = _drill(
      tmp_path, '--shard_params', '--width=4096', '--drill_wipe_local',
      extra_env={env.MAX_OBJECT_BYTES: '8192'})
  assert result.restart_count == 1
  assert not re.search(r'The local save of step \d+ .* failed|A local '
                       r'save to .* failed|over the limit', out), out[-3000:]
  assert digest == reference
  resumed = _resumed(out)
  assert {p: r[:2] for p, r in resumed.items()} == {
      0: (15, 'local'), 1: (15, 'local')}, out[-3000:]
  peers = {p: r[2] for p, r in resumed.items()}
  assert peers[0] == 0 and peers[1] > 8192, peers
  for p in (0, 1):  # Every save wrote its step, with its peer's copies.
    newest = max(folder.scan(str(tmp_path / f'local{p}')),
                 key=lambda s: s.step)
    assert newest.step == STEPS and newest.manifest['peer_keys'], p


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


@pytest.mark.parametrize('sharded', [False, True],
                         ids=['replicated', 'shard-params'])
def test_sigkill_restarts_a_wiped_host_with_the_same_hostname_from_its_peer(
    tmp_path, uninterrupted, sharded):
  why = _own_disks_unavailable()
  if why:
    pytest.skip(why)
  # Both processes have this machine's hostname and no $RECOVERY_HOST_ID;
  # each has a disk of its own at the same path. Process 1 deletes its local
  # folder, then SIGKILLs itself.
  extra = ['--shard_params'] if sharded else []
  result, out, digest = _drill(tmp_path, *extra, '--drill_wipe_local',
                               own_disks=True)
  assert result.restart_count == 1
  assert digest == uninterrupted
  resumed = _resumed(out)
  assert {p: r[:2] for p, r in resumed.items()} == {
      0: (15, 'local'), 1: (15, 'local')}, out[-3000:]
  # All host 1 needs came from host 0 (with --shard_params, the same 320
  # bytes as with two hostnames: its shards as host 0's peer copies, and
  # every replicated leaf); nothing went to host 0.
  peers = {p: r[2] for p, r in resumed.items()}
  assert peers[0] == 0 and peers[1] == (320 if sharded else 352), peers
  assert 'KeyError' not in out, out[-3000:]
  # Each disk holds its own process's folder only, the shared path nothing.
  assert not any((tmp_path / 'mnt').iterdir())
  for p in (0, 1):
    local = tmp_path / f'disk{p}' / 'local'
    assert sorted(e.name for e in local.iterdir()
                  if e.name.startswith('process_')) == [f'process_{p}']
    newest = max(folder.scan(str(local)), key=lambda s: s.step)
    assert newest.step == STEPS
    # Each disk is a host of its own: each writes the replicated leaves.
    assert ('data/cursor', ()) in newest.entries
    assert bool(newest.manifest['peer_keys']) == sharded, newest.manifest
  _report('same hostname, own disks', out, resumed, peers)
  assert not any(os.path.exists(f'/proc/{pid}') for a in result.attempts
                 for pid in a.pids)


def test_a_host_id_shared_by_processes_with_a_folder_each_falls_back_clearly(
    tmp_path, uninterrupted):
  # $RECOVERY_HOST_ID=shared on both processes, but a local folder each: the
  # replicated leaves were written once, in process 0's folder only. The
  # restart must name what is missing and take the persistent tier.
  result, out, digest = _drill(tmp_path, '--noasync_save', host_id='shared',
                               save_every=10)
  assert result.restart_count == 1
  assert digest == uninterrupted
  assert {p: r[:2] for p, r in _resumed(out).items()} == {
      0: (10, 'persistent'), 1: (10, 'persistent')}, out[-3000:]
  assert re.search(r'\$RECOVERY_HOST_ID=shared is set on processes \[0, 1\], '
                   r'but they see 2 different local folders', out), out[-3000:]
  for step in (15, 10):
    assert re.search(
        rf'CheckpointError: Block data/\w+ \[\] of local step {step} is '
        r'missing on process 1 \(host shared \(processes 0, 1 on [^)]+\), '
        rf'local folder {re.escape(str(tmp_path))}/local1\): the hosts\' '
        r'lists name it on shared ', out), out[-3000:]
  assert 'KeyError' not in out, out[-3000:]


def _report(what, out, resumed, peers):
  killed = float(re.search(r'SIGKILLs itself after step \d+ at (\d+\.\d+)',
                           out).group(1))
  # Restored on every process, about to train again.
  again = max(at for _, _, _, at in resumed.values())
  print(f'drill {what}: kill to training again {again - killed:.1f} s, '
        f'{KILL_AFTER - 15} steps lost, bytes from peers {peers}')




def test_a_restart_sets_a_damaged_newest_local_step_aside_and_ends_equal(
    tmp_path, uninterrupted):
  # Process 1 flips a byte of its newest local step (15), then SIGKILLs
  # itself: the restart finds step 15 failing its digest on every process,
  # sets each process's folder of it aside (kept), and restores step 10.
  result, out, digest = _drill(tmp_path, '--drill_damage_newest_local')
  assert result.restart_count == 1, result.summary
  assert 'Drill: damaged local step 15 in' in out, out[-3000:]
  assert {p: r[:2] for p, r in _resumed(out).items()} == {
      0: (10, 'local'), 1: (10, 'local')}, out[-3000:]
  assert digest == uninterrupted
  for p in (0, 1):
    own = tmp_path / f'local{p}' / f'process_{p}'
    (moved,) = [n for n in os.listdir(own) if '.damaged-' in n]
    assert re.fullmatch(r'15-[0-9a-f]{16}\.damaged-\d{8}T\d{6}Z', moved), moved
    assert (own / moved / 'data.bin').is_file()  # kept whole
    assert re.search(rf"\[process={p}\] Local step 15 failed its checks; set "
                     rf"this process's folder of it aside as {own / moved}",
                     out), out[-3000:]
  records = [json.loads(ln) for ln in
             (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert [(r['step'], r['tier']) for r in records
          if r.get('event') == 'set_aside'] == [(15, 'local')], records
