"""Runtime facts: this process's index, the process count, and the default timeout of every collective."""

from __future__ import annotations

import jax

from multihost import env as _env


_DEFAULT_TIMEOUT_S = 300.0
_default_timeout: float | None = None  # None: read _env.TIMEOUT, then the constant.


def set_default_timeout(seconds: float | None) -> None:
  """Sets the process-wide default timeout of every blocking collective.

  Args:
    seconds: a positive number of seconds, or None to go back to the
      `MULTIHOST_TIMEOUT` environment variable (or 300 s when it is unset).
  """
  global _default_timeout
  if seconds is not None and not seconds > 0:
    raise ValueError(
        f'The default timeout must be a positive number of seconds; got '
        f'{seconds!r}. Pass None to fall back to ${_env.TIMEOUT} or '
        f'{_DEFAULT_TIMEOUT_S:g} s.')
  _default_timeout = None if seconds is None else float(seconds)


def default_timeout() -> float:
  """The timeout, in seconds, used when a collective gets `timeout=None`."""
  if _default_timeout is not None:
    return _default_timeout
  return _env.number(_env.TIMEOUT, _DEFAULT_TIMEOUT_S, unit='seconds',
                     example='60')


def resolve_timeout(timeout: float | None) -> float:
  if timeout is None:
    return default_timeout()
  if not timeout > 0:
    raise ValueError(
        f'timeout must be a positive number of seconds; got {timeout!r}.')
  return float(timeout)


def process_index() -> int:
  return jax.process_index()


def process_count() -> int:
  return jax.process_count()


def is_multiprocess() -> bool:
  """True when more than one controller takes part (jax.distributed is up)."""
  return jax.process_count() > 1
