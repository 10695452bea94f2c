"""The README's "Using recovery in your training code" program, as printed.

Trained to step 30 and stopped, then the same command resumed to step 50
(saying so): the same final loss, bitwise, as an uninterrupted run to 50 on
the same topology (one controller, 4 devices); the step-30 checkpoint
resumed at 2 controllers x 2 devices ends within recovery's tolerances; run
once more, it resumes at 50 and says there is nothing left to train.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import _helpers
import numpy as np

from multihost import env as env_lib
from multihost import launch
import recovery

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY = sys.executable
HEADING = '## Using recovery in your training code'
TIMEOUT_S = 180
# Cluster variables a single-controller run must not inherit.
_CLUSTER_VARS = (env_lib.COORDINATOR, env_lib.NUM_PROCESSES,
                 env_lib.PROCESS_ID, env_lib.OMPI_HNP_URI, env_lib.OMPI_SIZE,
                 env_lib.SLURM_JOB_ID)


def _example() -> str:
  readme = (ROOT / 'README.md').read_text()
  section = readme.split(HEADING, 1)[1]
  return re.search(r'```python\n(.*?)```', section, re.S).group(1)


def _final(output: str) -> tuple[int, float]:
  line = [ln for ln in output.splitlines() if ln.startswith('step ')][-1]
  step, loss = re.fullmatch(r'step (\d+) loss (\S+)', line).groups()
  return int(step), float(loss)


def _resumed(output: str) -> int | None:
  found = re.findall(r'^resumed from step (\d+)$', output, re.M)
  return int(found[-1]) if found else None


def _single(script, *args) -> str:
  env = {k: v for k, v in os.environ.items()
         if k not in _CLUSTER_VARS + recovery.RESTART_COUNT_VARIABLES}
  env.update({env_lib.NUM_CPU_DEVICES: '4', env_lib.PLATFORMS: 'cpu',
              **_helpers.quick_compile_env()})
  proc = subprocess.run([PY, str(script), *map(str, args)], env=env, cwd=ROOT,
                        stdin=subprocess.DEVNULL, capture_output=True,
                        text=True, timeout=TIMEOUT_S, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def test_readme_example_stops_and_resumes(tmp_path):
  script = tmp_path / 'train_example.py'
  script.write_text(_example())
  first = _single(script, tmp_path / 'run', 30)
  assert _resumed(first) is None and _final(first)[0] == 30
  shutil.copytree(tmp_path / 'run', tmp_path / 'run2x2')
  out = _single(script, tmp_path / 'run', 50)
  assert _resumed(out) == 30, out
  resumed = _final(out)
  uninterrupted = _final(_single(script, tmp_path / 'ref', 50))
  assert resumed == uninterrupted and resumed[0] == 50
  result = launch.launch(
      [PY, str(script), str(tmp_path / 'run2x2'), '50'],
      num_processes=2, devices_per_process=2, timeout=TIMEOUT_S, cwd=ROOT,
      env=_helpers.quick_compile_env())
  assert result.ok, result.summary + result.outputs[0][-3000:]
  assert _resumed(result.outputs[0]) == 30, result.outputs[0][-3000:]
  step, loss = _final(result.outputs[0])
  assert step == 50
  np.testing.assert_allclose(loss, uninterrupted[1], rtol=recovery.RTOL,
                             atol=recovery.ATOL)
  done = _single(script, tmp_path / 'run', 50)
  assert _resumed(done) == 50, done
  assert 'step 50: nothing left to train' in done and 'None' not in done, done
