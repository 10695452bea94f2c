"""The restart-time drill (bench/restart_drill.py) runs once and reports every stage.

bin/train.py at 2 controllers x 2 CPU devices under `--max_restarts=1`,
process 1 SIGKILLed after step 150: the launcher stops the survivor at once
and the next attempt trains again from the local tier. The time itself is
measured by the drill, not judged here (docs/failures.md quotes it with its
command); the bound below only catches a restart that waits for heartbeats
or the grace period again.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
STAGES = ('detect', 'stop', 'start', 'import', 'initialize', 'restore',
          'first step')


def test_the_restart_drill_reports_each_stage_and_restarts_at_once():
  proc = subprocess.run(
      [sys.executable, str(ROOT / 'bench' / 'restart_drill.py'), '--runs=1'],
      cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-3000:]
  (line,) = [ln for ln in out.splitlines() if ln.startswith('run 0: ')]
  stages = {name: float(value) for name, value in
            re.findall(r'(detect|stop|start|import|initialize|restore|'
                       r'first step) (-?[\d.]+)', line)}
  assert tuple(stages) == STAGES, line
  assert all(value >= 0 for value in stages.values()), line
  total = float(re.search(r'total ([\d.]+) s', line).group(1))
  # Stopping the survivor takes the restart's kill wait (0.5 s), not the
  # grace period (15 s) or a heartbeat timeout (5 s here).
  assert stages['stop'] < 3, line
  assert total < 60, line
  assert 'survivor: killed by SIGKILL' in line, line
