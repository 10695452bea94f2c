"""Runtime facts: this process's index and message prefix, the process count, and the default timeout of every collective (the current runtime's)."""

from __future__ import annotations

from multihost import env as _env
from multihost._src.runtime import failures
from multihost._src.runtime import runtime
from multihost._src.runtime import settings


def set_default_timeout(seconds: float | None) -> None:
  """Sets the process-wide default timeout of every blocking collective.

  Args:
    seconds: a positive number of seconds, or None to go back to the
      `MULTIHOST_TIMEOUT` environment variable (or 300 s when it is unset).
  """
  if seconds is not None and not seconds > 0:
    raise ValueError(
        f'The default timeout must be a positive number of seconds; got '
        f'{seconds!r}. Pass None to fall back to ${_env.TIMEOUT} or '
        f'{settings.DEFAULT_TIMEOUT_S:g} s.')
  runtime.current().settings.default_timeout = (
      None if seconds is None else float(seconds))


def default_timeout() -> float:
  """The timeout, in seconds, used when a collective gets `timeout=None`."""
  return runtime.current().default_timeout()


def resolve_timeout(timeout: float | None) -> float:
  return runtime.current().resolve_timeout(timeout)


def process_index() -> int:
  return runtime.current().index


def process_count() -> int:
  return runtime.current().count


def process_prefix(index: int | None = None) -> str:
  """'[process=N]': how every message of multihost starts, for this process (or for process `index`).

  For a program's own messages to name the process the same way
  (`recovery` and bin/train.py use it).
  """
  return failures.prefix(index)
