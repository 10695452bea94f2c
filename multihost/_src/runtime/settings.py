"""Every multihost setting, parsed and validated in one place: the program's setters, else the environment, else the default.

The environment variables' names are `multihost.env`'s; this module is the
only one in the library that reads their values (the launcher and the
pytest plugin, which run without JAX, set them). Each reader raises a
ValueError that names the variable, its value and the fix; values are read
when asked, so a test or a program may change a variable between calls.
The settings every process must share to agree on a call (`shared`) travel
in each call's agreement.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

from multihost import env

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_STALL_REPORT_S = 60.0
DEFAULT_MAX_OBJECT_BYTES = 1 << 30
DEFAULT_RESULT_POOL_MIB = 512
DEFAULT_TCP_LANES = 2
MAX_TCP_LANES = 8
DEFAULT_FLIGHT_RING = 64
TRANSPORTS = ('tcp', 'device')


def _get(name: str) -> str | None:
  """os.environ.get(name), without its cost for an unset variable.

  os.environ.get of an unset variable raises and catches a KeyError inside
  (microseconds, on every collective call): where os.environ keeps its dict
  of encoded names (CPython's `_Environ`), that dict is read itself.
  """
  data = getattr(os.environ, '_data', None)
  if isinstance(data, dict):
    try:
      key = _KEYS.get(name)
      if key is None:
        key = _KEYS[name] = os.environ.encodekey(name)
      value = data.get(key)
      return None if value is None else os.environ.decodevalue(value)
    except AttributeError:
      pass
  return os.environ.get(name)


# Each variable's name as os.environ's dict keys it (`_get`), encoded once:
# the names are this module's few constants.
_KEYS: dict[str, object] = {}


def _text(name: str) -> str:
  return (_get(name) or '').strip()


def number(name: str, default: float, *, unit: str, example: str,
           zero_ok: bool = False, integer: bool = False) -> float:
  """Numeric variable `name`: `default` when unset or empty, else its value.

  Raises:
    ValueError: the value is not a number, or not > 0 (>= 0 with
      `zero_ok`); the message names the variable, the value and an example.
  """
  text = _text(name)
  if not text:
    return default
  try:
    value = int(text) if integer else float(text)
  except ValueError:
    value = None
  if value is None or not (value >= 0 if zero_ok else value > 0):
    what = f'number of {unit} >= 0' if zero_ok else f'positive number of {unit}'
    raise ValueError(f'${name}={text!r} is not a {what}. Set it to e.g. '
                     f'{example}, or unset it.')
  return value


def is_off(name: str) -> bool:
  """Whether variable `name` is set to a false value (0/false/no/off)."""
  return _text(name).lower() in ('0', 'false', 'no', 'off')


def timeout() -> float:
  """$MULTIHOST_TIMEOUT: a collective's timeout when none is given or set."""
  return number(env.TIMEOUT, DEFAULT_TIMEOUT_S, unit='seconds', example='60')


def timeout_is_set() -> bool:
  """Whether $MULTIHOST_TIMEOUT is set (what advice names as the timeout's source)."""
  return bool(_text(env.TIMEOUT))


def transport() -> str | None:
  """$MULTIHOST_TRANSPORT: 'tcp' or 'device' forced for every payload, None when unset."""
  raw = _get(env.TRANSPORT)
  if raw is None:  # (unset: every call asks)
    return None
  value = raw.strip().lower()
  if value not in ('', *TRANSPORTS):
    raise ValueError(
        f'${env.TRANSPORT}={value!r} is not a transport; use tcp, device, '
        'or leave it unset (chosen by backend: see '
        'multihost._src.transport.choice).')
  return value or None


def tcp_lanes() -> int:
  """$MULTIHOST_TCP_LANES: TCP connections per pair of processes a large broadcast stripes over."""
  lanes = int(number(env.TCP_LANES, DEFAULT_TCP_LANES, unit='connections',
                     example='2', integer=True))
  if lanes > MAX_TCP_LANES:
    raise ValueError(f'${env.TCP_LANES}={lanes} is more than {MAX_TCP_LANES} '
                     f'connections per pair of processes; set 1 to '
                     f'{MAX_TCP_LANES}, or unset it ({DEFAULT_TCP_LANES}).')
  return lanes


def tcp_congestion() -> str | None:
  """$MULTIHOST_TCP_CONGESTION: the TCP links' congestion control: 'auto' (unset: reno where the host's default is bbr), a name, or None ('keep': the host's default)."""
  value = _text(env.TCP_CONGESTION).lower()
  if value in ('', 'auto'):
    return 'auto'
  if value == 'keep':
    return None
  if not value.replace('_', '').isalnum() or len(value) > 15:
    raise ValueError(
        f'${env.TCP_CONGESTION}={value!r} is not a congestion control\'s '
        'name; set auto (the default), keep (the host\'s default), or a name '
        'the kernel allows (/proc/sys/net/ipv4/'
        'tcp_allowed_congestion_control, e.g. reno).')
  return value


def local_links() -> bool:
  """$MULTIHOST_LOCAL_LINKS: whether links to processes on this host may use a local (Unix domain) socket (Linux only)."""
  return sys.platform.startswith('linux') and not is_off(env.LOCAL_LINKS)


def stall_report_after() -> float:
  """$MULTIHOST_STALL_REPORT_AFTER: seconds before a waiting collective logs a stall report (0: never)."""
  return number(env.STALL_REPORT_AFTER, DEFAULT_STALL_REPORT_S,
                unit='seconds', example='60 (0: no stall reports)',
                zero_ok=True)


def flight_ring() -> int:
  """$MULTIHOST_FLIGHT_RING: calls and events each flight recorder keeps."""
  return int(number(env.FLIGHT_RING, DEFAULT_FLIGHT_RING, unit='calls',
                    example='256', integer=True))


def max_object_bytes() -> int:
  """$MULTIHOST_MAX_OBJECT_BYTES: the largest pickled object accepted from a peer."""
  return int(number(env.MAX_OBJECT_BYTES, DEFAULT_MAX_OBJECT_BYTES,
                    unit='bytes', example='1073741824', integer=True))


def result_pool_bytes() -> int:
  """$MULTIHOST_RESULT_POOL_MIB, in bytes: idle result memory kept for later calls (0: none)."""
  return int(number(env.RESULT_POOL_MIB, DEFAULT_RESULT_POOL_MIB, unit='MiB',
                    example='64', zero_ok=True) * (1 << 20))


def heartbeat() -> float | None:
  """$MULTIHOST_HEARTBEAT_TIMEOUT: seconds without a heartbeat before a peer is dead (None: unset)."""
  if not _text(env.HEARTBEAT):
    return None
  return number(env.HEARTBEAT, 0, unit='seconds', example='10')


def detect_failures() -> bool:
  """Whether failure detection is on: neither $MULTIHOST_DETECT_FAILURES nor $JAX_ENABLE_RECOVERABILITY is off."""
  return not (is_off(env.DETECT_FAILURES) or
              is_off(env.ENABLE_RECOVERABILITY))


def companion_service() -> bool:
  """Whether a companion process of process 0 hosts the service ($MULTIHOST_COMPANION_SERVICE not off)."""
  return not is_off(env.COMPANION_SERVICE)


def exit_on_peer_failure() -> bool:
  """Whether a process whose peer failed may leave by itself ($MULTIHOST_EXIT_ON_PEER_FAILURE not off)."""
  return not is_off(env.EXIT_ON_PEER_FAILURE)


def step_deadline() -> float | None:
  """$MULTIHOST_STEP_DEADLINE: a training step's fixed deadline in seconds, 0 when off, None when learned (unset or 'auto')."""
  text = _text(env.STEP_DEADLINE).lower()
  if text in ('', 'auto'):
    return None
  if is_off(env.STEP_DEADLINE):
    return 0.0
  return number(env.STEP_DEADLINE, 0, unit='seconds',
                example="600 (a fixed deadline), 'auto' (learned) or 'off'",
                zero_ok=True)


def external_service() -> bool:
  """Whether a launcher hosts the coordination service ($MULTIHOST_EXTERNAL_SERVICE=1)."""
  return _text(env.EXTERNAL_SERVICE) == '1'


def trace_dir() -> str | None:
  """$MULTIHOST_TRACE_DIR: where the flight recorder is written at exit (set by `launch --trace`)."""
  return _text(env.TRACE_DIR) or None


def job_secret_file() -> str | None:
  """$MULTIHOST_JOB_SECRET_FILE: the path of the job secret's file, if set."""
  return _text(env.JOB_SECRET_FILE) or None


def restart_count() -> int:
  """$MULTIHOST_RESTART_COUNT: how many times the launcher restarted the job before this attempt."""
  return int(number(env.RESTART_COUNT, 0, unit='restarts', example='0',
                    zero_ok=True, integer=True))


def shared() -> tuple[tuple[str, str], ...]:
  """The settings every process must share to agree on a call: (variable, value) pairs, part of every call's agreement."""
  # Every call reads the variables' raw values; they are parsed only when
  # they changed (`_shared_of` keeps its last answer).
  return _shared_of((_get(env.TCP_LANES), _get(env.TRANSPORT)))


@functools.lru_cache(maxsize=1)
def _shared_of(raw: tuple[Any, Any]) -> tuple[tuple[str, str], ...]:
  """`shared`'s answer for the variables' raw values `raw` (read again here: the same values)."""
  del raw  # The cache's key.
  return ((env.TCP_LANES, str(tcp_lanes())),
          (env.TRANSPORT, transport() or 'unset'))


class Settings:
  """One runtime's settings: what the program set through the setters (None: unset), else the environment's value."""

  __slots__ = ('default_timeout', 'stall_report_after', 'exit_on_peer_failure',
               'step_deadline')

  def __init__(self):
    self.default_timeout: float | None = None
    self.stall_report_after: float | None = None
    # `multihost.set_exit_on_peer_failure`'s arguments (enabled, grace,
    # before_exit), applied to each watchdog's policy.
    self.exit_on_peer_failure: tuple[bool, float | None, Any] | None = None
    # `multihost.set_step_deadline`'s rule (a `liveness.step_rule.Rule`).
    self.step_deadline: Any = None

  def timeout(self) -> float:
    """The timeout of a collective called with `timeout=None`."""
    if self.default_timeout is not None:
      return self.default_timeout
    return timeout()

  def stall_report(self) -> float:
    """Seconds a collective waits before logging a stall report (0: never)."""
    if self.stall_report_after is not None:
      return self.stall_report_after
    return stall_report_after()

  def peer_loss(self) -> tuple[bool, float | None, Any]:
    """(enabled, grace, before_exit) of leaving after a peer's failure."""
    if self.exit_on_peer_failure is not None:
      return self.exit_on_peer_failure
    return exit_on_peer_failure(), None, None
