"""The scale drill (bench/scale_drill.py) runs at P=2 and 3 and reports every stage of every row.

The times themselves are measured by the drill, not judged here
(docs/performance.md, "Scale drill on one machine", quotes them with their
command): this checks that each P's row carries every stage as a positive
number, that the links were set up, and that the fits name both forms.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
STAGES = ('first_call_ms', 'links_ready_ms', 'allgather_8b_ms', 'barrier_ms',
          'broadcast_8b_ms', 'broadcast_1mib_ms', 'init_s', 'links_setup_ms')


def test_the_scale_drill_reports_every_stage_for_every_p(tmp_path):
  out = tmp_path / 'scale.json'
  proc = subprocess.run(
      [sys.executable, str(ROOT / 'bench' / 'scale_drill.py'),
       '--processes=2,3', '--repeats=3', f'--out={out}', '--timeout=150'],
      cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
  text = proc.stdout + proc.stderr
  assert proc.returncode == 0, text[-3000:]
  report = json.loads(out.read_text())
  assert [row['P'] for row in report['rows']] == [2, 3], report
  for row in report['rows']:
    for stage in STAGES:
      value = row.get(stage)
      assert isinstance(value, float) and math.isfinite(value), (stage, row)
      assert value > 0, (stage, row)
    assert row['links_usable'] is True, row
    assert row['repeats'] == 3, row
    # Ready only after the first call returned.
    assert row['links_ready_ms'] >= row['first_call_ms'], row
  assert {f['stage'] for f in report['fits']} == set(STAGES) - {'init_s'}
  for f in report['fits']:
    assert set(f['log2P']) == set(f['P']) == {'a', 'b', 'rss'}, f
  # The printed table has one line per P.
  assert any(line.startswith('| 3 | ') for line in text.splitlines()), text
