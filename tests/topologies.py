"""`topologies('2x4', '4x1', timeout=240)`: a test parametrized over multi-controller topologies.

Each 'PxD' name becomes a `topology` parameter of that id, marked to run as
P real controllers with D CPU devices each (`@pytest.mark.multihost`).
"""

import pytest


def topologies(*names: str, timeout: float):
  params = []
  for name in names:
    processes, devices = (int(n) for n in name.split('x'))
    params.append(pytest.param(name, marks=pytest.mark.multihost(
        num_processes=processes, devices_per_process=devices,
        timeout=timeout)))
  return pytest.mark.parametrize('topology', params)
