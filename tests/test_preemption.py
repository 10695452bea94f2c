"""Preemption agreement for real: SIGTERM to one controller, all stop together."""

from __future__ import annotations

import re
import signal
import sys
import textwrap

from multihost import launch

_LOOP = textwrap.dedent('''
    import time
    import multihost
    multihost.initialize()
    import jax
    for step in range(100000):
      if multihost.reached_preemption_sync_point(step):
        print(f'SYNC {step}', flush=True)
        break
      if step == 5:
        print('READY', flush=True)
      time.sleep(0.01 * (1 + jax.process_index()))  # Processes at other paces.
    else:
      raise SystemExit('never reached the preemption sync point')
''')


def test_sigterm_to_one_process_stops_every_process_at_the_same_step(tmp_path):
  script = tmp_path / 'loop.py'
  script.write_text(_LOOP)
  with launch.Controllers([sys.executable, str(script)], num_processes=3,
                          devices_per_process=1) as cluster:
    for i in range(3):
      cluster.wait_for_output(i, 'READY', timeout=60)
    cluster.kill(2, signal.SIGTERM)  # Not process 0, not its neighbour only.
    result = cluster.wait(timeout=60)
  assert result.ok, result.summary
  steps = [re.findall(r'SYNC (\d+)', out) for out in result.outputs]
  assert all(len(s) == 1 for s in steps), result.outputs
  assert len({s[0] for s in steps}) == 1, steps  # The same step everywhere.
  assert int(steps[0][0]) > 5
