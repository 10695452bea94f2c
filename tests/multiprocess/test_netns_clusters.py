"""Controllers across simulated hosts started the way Slurm and Open MPI start them: `multihost.initialize()` with no arguments and no coordinator address."""

from __future__ import annotations

import subprocess

import _schedulers
import pytest

from multihost import netns

_OK, _WHY = netns.available()
pytestmark = pytest.mark.skipif(not _OK, reason=_WHY or 'no simulated hosts')

_PORT = 23456

@pytest.mark.parametrize('scheduler,companion', [
    ('slurm', False), ('ompi', False), ('slurm', True)])
def test_initialize_picks_up_the_schedulers_variables_across_hosts(
    scheduler, companion):
  n = 2
  with netns.SimulatedHosts(n) as net:
    procs, outs = _schedulers.run_on_hosts(
        net, n, 'scheduler_hosts', scheduler=scheduler, companion=companion,
        port=_PORT, job='4242')
    codes = [p.returncode for p in procs]
    # Nothing is left inside host 0 (with companion: it left with process 0).
    left = subprocess.run(['ip', 'netns', 'pids', net.namespace(0)],
                          capture_output=True, text=True,
                          timeout=30).stdout.split()
    assert codes == [0] * n, '\n\n'.join(o[-3000:] for o in outs)
    assert left == []
    want = [net.address(k) for k in range(n)]
    for i, out in enumerate(outs):
      line = out.split('RESULT ', 1)[1].splitlines()[0]
      assert line == f'{i} {n} {want!r}', line
