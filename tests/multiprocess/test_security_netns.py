"""Nothing multihost opens listens on every interface, under each cluster's auto-detection, in a network namespace of its own (`ss -ltn`)."""

from __future__ import annotations

import _schedulers
import pytest

from multihost import env as mh_env
from multihost import netns

_OK, _WHY = netns.available()
pytestmark = pytest.mark.skipif(not _OK, reason=_WHY or 'no simulated hosts')

_PORT = 23457
_EVERYWHERE = ('*:', '0.0.0.0:', '[::]:')


@pytest.mark.parametrize('scheduler,companion', [
    ('slurm', False), ('ompi', False), ('slurm', True)])
def test_no_listener_on_every_interface_under_a_schedulers_variables(
    scheduler, companion):
  n = 2
  with netns.SimulatedHosts(n) as net:
    procs, outs = _schedulers.run_on_hosts(
        net, n, 'listeners', scheduler=scheduler, companion=companion,
        port=_PORT, job='4243', **{mh_env.TIMEOUT: '30'})
    assert [p.returncode for p in procs] == [0] * n, '\n\n'.join(
        o[-3000:] for o in outs)
    listening = [l.split()[1] for l in outs[0].splitlines()
                 if l.startswith('LISTEN ')]
    # The coordination service (or its companion) and the data plane.
    host = net.address(0)
    assert {f'{host}:{_PORT}', f'[::ffff:{host}]:{_PORT}'} & set(listening), (
        outs[0])
    assert len(listening) >= 2, listening
    assert not [a for a in listening if a.startswith(_EVERYWHERE)], listening
