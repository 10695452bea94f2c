"""The `@pytest.mark.multihost(...)` marker: its arguments, and the group of tests that share one launch."""

from __future__ import annotations

import dataclasses

import pytest

from multihost import env as env_lib

MARKER = 'multihost'
WORKER_ENV = env_lib.PYTEST_WORKER
BARRIER_TIMEOUT_ENV = env_lib.PYTEST_BARRIER_TIMEOUT
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
# The plugin's names in pytest's plugin manager, in the parent and in the
# workers.
PARENT_PLUGIN = 'multihost-parent'
WORKER_PLUGIN = 'multihost-worker'
# Set by a worker on its serialized teardown report: the test passed on this
# process, which only reports that a peer failed.
PEER_FAILURE = 'multihost_peer_failure'


@dataclasses.dataclass(frozen=True)
class GroupSpec:
  """What a group of marked tests shares: one launch runs them all."""
  module: str
  num_processes: int
  devices_per_process: int
  timeout: float
  hosts: str | None = None


def marker_spec(item: pytest.Item) -> GroupSpec | None:
  """The test's group, or None when it is not marked.

  Raises:
    pytest.UsageError: the marker's arguments are invalid (named).
  """
  marker = item.get_closest_marker(MARKER)
  if marker is None:
    return None

  def spec(num_processes: int = 2, devices_per_process: int = 1,
           timeout: float = DEFAULT_TIMEOUT_S,
           hosts: str | None = None) -> GroupSpec:
    if hosts not in (None, 'netns'):
      raise ValueError(f"got hosts={hosts!r}; use None or 'netns'")
    if not (isinstance(num_processes, int) and num_processes >= 1 and
            isinstance(devices_per_process, int) and devices_per_process >= 1
            and timeout > 0):
      raise ValueError(
          f'got num_processes={num_processes!r}, devices_per_process='
          f'{devices_per_process!r}, timeout={timeout!r}')
    return GroupSpec(item.nodeid.split('::', 1)[0], num_processes,
                     devices_per_process, float(timeout), hosts)

  try:
    return spec(*marker.args, **marker.kwargs)
  except (TypeError, ValueError) as e:
    raise pytest.UsageError(
        f'{item.nodeid}: invalid @pytest.mark.{MARKER}(...): {e}. Use '
        f'@pytest.mark.{MARKER}(num_processes=2, devices_per_process=1, '
        'timeout=300) with positive integers and a positive timeout.'
    ) from None
