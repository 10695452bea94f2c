"""Exceptions raised by multihost.

Every exception raised by a collective is raised on every participating process,
so that all controllers fail together and can react (save, exit) together.
"""

from __future__ import annotations

from collections.abc import Iterable


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


class ProcessFailureError(MultihostError):
  """A peer process died (or became unreachable) during or between collectives.

  Attributes:
    operation: the collective in progress, or '' between collectives.
    failed: indices of the processes that are gone.
  """

  def __init__(self, message: str, *, operation: str = '',
               failed: Iterable[int] = ()):
    super().__init__(message)
    self.operation = operation
    self.failed = tuple(sorted(failed))
