"""Unit tests: one process, the in-memory coordination fake, seconds in all.

A test here that starts controllers (the launcher, `launch.Controllers`, or
the `multihost` marker) fails at once: it belongs in tests/multiprocess/.
"""

import pathlib

import pytest

from multihost import launch

_HERE = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
  for item in items:
    if (item.path.is_relative_to(_HERE)
        and item.get_closest_marker('multihost') is not None):
      raise pytest.UsageError(
          f'{item.nodeid} is marked multihost (real controllers): move it '
          'to tests/multiprocess/.')


@pytest.fixture(autouse=True)
def _no_controllers(monkeypatch):
  def refuse(*args, **kwargs):
    del args, kwargs
    raise AssertionError('a unit test started controllers; move it to '
                         'tests/multiprocess/')

  monkeypatch.setattr(launch, 'launch', refuse)
  monkeypatch.setattr(launch, 'Controllers', refuse)
