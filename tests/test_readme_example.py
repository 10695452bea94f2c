"""The README's "Using recovery in your training code" program, as printed.

Trained to step 30 and stopped, then resumed to step 50: the same final loss,
bitwise, as an uninterrupted run to 50 on the same topology (one controller,
4 devices); the step-30 checkpoint resumed at 2 controllers x 2 devices ends
within recovery's tolerances.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np

from multihost import launch
from multihost import env as env_lib
import recovery

ROOT = pathlib.Path(__file__).resolve().parents[1]
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
  line = [l for l in output.splitlines() if l.startswith('step ')][-1]
  step, loss = re.fullmatch(r'step (\d+) loss (\S+)', line).groups()
  return int(step), float(loss)


def _single(script, *args) -> tuple[int, float]:
  env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_VARS}
  env.update({env_lib.NUM_CPU_DEVICES: '4', env_lib.PLATFORMS: 'cpu'})
  proc = subprocess.run([PY, str(script), *map(str, args)], env=env, cwd=ROOT,
                        stdin=subprocess.DEVNULL, capture_output=True,
                        text=True, timeout=TIMEOUT_S, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return _final(proc.stdout)


def test_readme_example_stops_and_resumes(tmp_path):
  script = tmp_path / 'train_example.py'
  script.write_text(_example())
  assert _single(script, tmp_path / 'run', 30)[0] == 30
  shutil.copytree(tmp_path / 'run', tmp_path / 'run2x2')
  resumed = _single(script, tmp_path / 'run', 50, '--resume')
  uninterrupted = _single(script, tmp_path / 'ref', 50)
  assert resumed == uninterrupted and resumed[0] == 50
  result = launch.launch(
      [PY, str(script), str(tmp_path / 'run2x2'), '50', '--resume'],
      num_processes=2, devices_per_process=2, timeout=TIMEOUT_S, cwd=ROOT)
  assert result.ok, result.summary + result.outputs[0][-3000:]
  step, loss = _final(result.outputs[0])
  assert step == 50
  np.testing.assert_allclose(loss, uninterrupted[1], rtol=recovery.RTOL,
                             atol=recovery.ATOL)
