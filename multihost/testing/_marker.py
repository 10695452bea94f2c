"""The `@pytest.mark.multihost(...)` marker: its arguments, and the group of tests that share one launch."""

from __future__ import annotations

import collections.abc
import dataclasses
import os

import pytest

from multihost import env as env_lib

MARKER = 'multihost'
WORKER_ENV = env_lib.PYTEST_WORKER
BARRIER_TIMEOUT_ENV = env_lib.PYTEST_BARRIER_TIMEOUT
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
TIMEOUT_SCALE_ENV = env_lib.PYTEST_TIMEOUT_SCALE
# The most a loaded machine stretches a group's timeout by.
MAX_LOAD_SCALE = 4.0
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
  # The marker's timeout is `timeout / scale` (see `scaled`).
  scale: float = 1.0

  def scaled(self, factor: float) -> GroupSpec:
    """This group with its timeout multiplied by `factor` (`timeout_scale`)."""
    return dataclasses.replace(self, timeout=self.timeout * factor,
                               scale=self.scale * factor)


def timeout_scale(num_processes: int, *,
                  environ: collections.abc.Mapping[str, str] = os.environ,
                  load: float | None = None, cpus: int | None = None) -> float:
  """How much longer a group of `num_processes` gets on this machine now: $MULTIHOST_PYTEST_TIMEOUT_SCALE when set, else the runnable processes per CPU (the 1-minute load average plus the group's own), from 1 to `MAX_LOAD_SCALE`.

  On an idle machine with a CPU per process a group gets its marker's
  timeout; on a machine shared with other work (a 2-core CI runner) it gets
  up to 4 times that, so that a group that only waited for CPU is not
  stopped as hung.

  Raises:
    ValueError: $MULTIHOST_PYTEST_TIMEOUT_SCALE is not a positive number.
  """
  given = environ.get(TIMEOUT_SCALE_ENV, '').strip()
  if given:
    try:
      factor = float(given)
    except ValueError:
      factor = 0.0
    if not factor > 0:
      raise ValueError(f'${TIMEOUT_SCALE_ENV}={given!r}: give a positive '
                       'number (e.g. 2), or unset it to scale with the load.')
    return factor
  if load is None:
    try:
      load = os.getloadavg()[0]
    except OSError:
      load = 0.0
  cpus = cpus or os.cpu_count() or 1
  return min(MAX_LOAD_SCALE, max(1.0, (load + num_processes) / cpus))


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
