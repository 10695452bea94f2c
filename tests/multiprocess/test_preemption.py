"""Preemption agreement for real: SIGTERM to one controller, all stop together."""

from __future__ import annotations

import re
import signal

from _helpers import program

from multihost import launch


def test_sigterm_to_one_process_stops_every_process_at_the_same_step():
  with launch.Controllers(program('preemption_loop'), num_processes=3,
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
