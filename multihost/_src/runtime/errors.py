"""Exceptions raised by multihost.

Every exception raised by a collective is raised on every participating process,
so that all controllers fail together and can react (save, exit) together.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
from jax.experimental import multihost_utils as _jax_multihost_utils


class MultihostError(RuntimeError):
  """Base class for all errors raised by multihost."""


class NotInitializedError(MultihostError):
  """A multi-process facility was used before `jax.distributed` was initialized."""


class ConsistencyError(MultihostError, AssertionError):
  """Processes disagreed: different values, names, shapes, dtypes or trees.

  Also an `AssertionError`, so code written against
  `jax.experimental.multihost_utils` (which raises `AssertionError`) keeps
  working.
  """


class CollectiveTimeoutError(MultihostError, TimeoutError):
  """A collective did not complete in time.

  Attributes:
    operation: the collective's name.
    missing: indices of the processes that did not arrive.
    waited: seconds waited.
  """

  def __init__(self, message: str, *, operation: str = '',
               missing: Iterable[int] = (), waited: float = 0.0):
    super().__init__(message)
    self.operation = operation
    self.missing = tuple(sorted(missing))
    self.waited = waited


class ProcessFailureError(MultihostError,
                          _jax_multihost_utils.ProcessFailureError):
  """A peer process died (or became unreachable) during or between collectives.

  Also JAX's `jax.experimental.multihost_utils.ProcessFailureError` (the
  error of its `live_devices`), so code written against JAX that catches
  that class catches this one too, and reads `.failed_devices`.

  Attributes:
    operation: the collective in progress, or '' between collectives.
    failed: indices of the processes that are gone.
    failed_devices: the set of their devices, as JAX's attribute of that
      name: by default every device of `failed` in `jax.devices()`;
      `multihost.live_devices` passes those among the devices it was given.
  """

  def __init__(self, message: str, *, operation: str = '',
               failed: Iterable[int] = (),
               failed_devices: Iterable[jax.Device] | None = None):
    # JAX's __init__ is not called: it would replace the message with
    # 'Devices failed: {...}'. Its one attribute is set here instead.
    MultihostError.__init__(self, message)
    self.operation = operation
    self.failed = tuple(sorted(failed))
    if failed_devices is None:
      failed_devices = _devices_of(self.failed)
    self.failed_devices = set(failed_devices)


def _devices_of(processes: tuple[int, ...]) -> set[jax.Device]:
  """The devices of `processes` (none when JAX has no backend to ask)."""
  if not processes:
    return set()
  try:
    devices = jax.devices()
  except Exception:  # noqa: BLE001  An error must not fail to construct.
    return set()
  return {d for d in devices if d.process_index in processes}
