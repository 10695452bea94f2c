"""Recovery with the states real training code carries, in real controllers: 2x2, then resumed at 1x4 and 4x1 (bitwise on the same topology).

The workloads are in tests/states_workload.py; the one-controller runs are
in tests/unit/test_states.py.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import _helpers
import numpy as np
import pytest
import states_workload as workload

from multihost import launch
import recovery

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / 'tests' / 'states_workload.py')
PY = sys.executable
LAUNCH_TIMEOUT_S = 240


def _by_step(losses: dict) -> dict[int, float]:
  return {int(s): v for s, v in losses.items()}


def _after_stop(losses: dict) -> dict[int, float]:
  return {s: v for s, v in _by_step(losses).items() if s > workload.STOP_AT}


# -- one controller ---------------------------------------------------------


# -- several controllers: 2x2, resumed at 2x2, 1x4 and 4x1 ---------------------


def _launch(mode: str, out: pathlib.Path, directory: pathlib.Path, *,
            num_processes: int, devices_per_process: int) -> dict:
  result = launch.launch(
      [PY, SCRIPT, mode, str(out), str(directory)],
      num_processes=num_processes, devices_per_process=devices_per_process,
      timeout=LAUNCH_TIMEOUT_S, cwd=ROOT, env=_helpers.quick_compile_env())
  assert result.ok, result.summary + '\n' + '\n'.join(
      o[-4000:] for o in result.outputs)
  return json.loads(out.read_text())


@pytest.fixture(scope='module')
def two_by_two(tmp_path_factory):
  """Every kind at 2 processes x 2 devices: an uninterrupted run to step 8;
  a run stopped at STOP_AT, mid-epoch (its checkpoint copied to `saved`),
  resumed."""
  tmp = tmp_path_factory.mktemp('states2x2')
  out = _launch('fresh', tmp / 'out.json', tmp / 'ckpt', num_processes=2,
                devices_per_process=2)
  return dict(saved=tmp / 'ckpt' / 'saved', losses=out)


@pytest.mark.parametrize('kind', workload.KINDS)
def test_two_by_two_resume_is_bitwise_the_uninterrupted_run(two_by_two, kind):
  losses = two_by_two['losses'][kind]
  ref = _by_step(losses['ref'])
  assert _by_step(losses['first']) == {
      s: v for s, v in ref.items() if s <= workload.STOP_AT}
  assert _by_step(losses['resumed']) == _after_stop(losses['ref'])


# Static fields (TrainState.apply_fn and tx, the nnx GraphDef) print with a
# memory address that differs between processes; multihost must ignore it.
@pytest.mark.parametrize('kind', ['optax', 'mixed', 'linen', 'nnx'])
@pytest.mark.parametrize('check', ['tree_digest', 'assert_equal'])
def test_multihost_agrees_on_raw_states_across_controllers(two_by_two, kind,
                                                          check):
  assert two_by_two['losses'][kind]['raw'][check]


def test_two_by_two_checkpoint_resumes_at_one_by_four_and_four_by_one(
    two_by_two, tmp_path):
  for layout in ('1x4', '4x1'):
    shutil.copytree(two_by_two['saved'], tmp_path / layout)
  # 1x4: this process (one controller, 4 devices).
  resumed = {'1x4': {
      kind: workload.train(kind, str(tmp_path / '1x4' / kind),
                           until=workload.UNTIL, resume=True)
      for kind in workload.KINDS}}
  out = _launch('resume', tmp_path / 'out4x1.json', tmp_path / '4x1',
                num_processes=4, devices_per_process=1)
  resumed['4x1'] = {kind: _by_step(out[kind]['resumed']) for kind in out}
  for layout, by_kind in resumed.items():
    assert sorted(by_kind) == sorted(workload.KINDS), layout
    for kind, losses in by_kind.items():
      want = _after_stop(two_by_two['losses'][kind]['ref'])
      assert sorted(losses) == sorted(want), (layout, kind)
      np.testing.assert_allclose(
          [losses[s] for s in sorted(want)], [want[s] for s in sorted(want)],
          rtol=recovery.RTOL, atol=recovery.ATOL, err_msg=f'{layout} {kind}')
