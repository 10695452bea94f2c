"""Low-precision states through the local tier's peer copies, 2 controllers x 2 devices.

tests/programs/dtype_states.py, each controller a host of its own
($RECOVERY_HOST_ID, a local folder each): the dtype matrix restored on a
replaced host from its peer, bit for bit; and a bfloat16 sharded state,
trained, SIGKILLed and resumed from the local tier with peer copies, equal
to the uninterrupted run.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

import _helpers

from multihost import launch
import recovery

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROGRAM = str(ROOT / 'tests' / 'programs' / 'dtype_states.py')
PY = sys.executable
STEPS, KILL_AFTER = 14, 10


def _launch(*args, max_restarts=0):
  env = {**{k: v for k, v in os.environ.items()
            if k not in (recovery.HOST_ID_VARIABLE,
                         *recovery.RESTART_COUNT_VARIABLES)},
         **_helpers.quick_compile_env()}
  command = (f'exec env {recovery.HOST_ID_VARIABLE}=host$JAX_PROCESS_ID '
             f'"{PY}" "{PROGRAM}" ' + ' '.join(map(str, args)))
  result = launch.launch(['sh', '-c', command], num_processes=2,
                         devices_per_process=2, grace_period=1,
                         kill_wait=0.5, timeout=150, max_restarts=max_restarts,
                         cwd=ROOT, env=env)
  out = '\n'.join(o for a in result.attempts for o in a.outputs)
  assert result.ok, result.summary + '\n' + out[-4000:]
  assert not any(os.path.exists(f'/proc/{pid}') for a in result.attempts
                 for pid in a.pids)
  return result, out


def _resumed(out: str) -> dict[int, tuple[str, int, int]]:
  return {int(p): (t, int(s), int(b)) for p, t, s, b in re.findall(
      r'^process (\d): resumed (\w+) (\d+), (\d+) bytes from peers', out,
      re.M)}


def test_every_dtype_and_kind_restores_on_a_replaced_host_from_its_peer(
    tmp_path):
  _, out = _launch('matrix', tmp_path)
  assert sorted(re.findall(r'^process (\d): .*differences (.*)$', out,
                           re.M)) == [('0', '[]'), ('1', '[]')], out[-4000:]
  resumed = _resumed(out)
  assert {p: r[:2] for p, r in resumed.items()} == {
      0: ('local', 4), 1: ('local', 4)}, out[-4000:]
  # Process 1 had nothing: its shards came from host 0's peer copies, its
  # host-held leaves from host 0's own blocks.
  assert resumed[0][2] == 0 and resumed[1][2] > 0, resumed


def test_a_bfloat16_sharded_state_killed_resumes_from_peers_equal(tmp_path):
  _, reference = _launch('drill', tmp_path / 'reference', STEPS, 0)
  result, out = _launch('drill', tmp_path / 'drill', STEPS, KILL_AFTER,
                        max_restarts=1)
  assert result.restart_count == 1, result.summary
  assert f'process 1: SIGKILL after step {KILL_AFTER}' in out, out[-4000:]
  resumed = _resumed(out)
  assert {p: r[:2] for p, r in resumed.items()} == {
      0: ('local', 9), 1: ('local', 9)}, out[-4000:]
  assert resumed[0][2] == 0 and resumed[1][2] > 0, resumed
  final = re.findall(r'^final step (\d+) digest (\w+)$', out, re.M)
  want = re.findall(r'^final step (\d+) digest (\w+)$', reference, re.M)
  assert want == [(str(STEPS), want[0][1])] * 2, reference[-4000:]
  assert final == want, out[-4000:]
