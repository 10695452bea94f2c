"""Runtime: the one object that holds this process's multihost state, and the one handle to it.

`Runtime` owns the process facts (index, count, default timeout), the
coordination client (a `runtime.coordination.Client`), the job secret, the call
counter, the rendezvous' fast-path state, the flight recorder, the logger
that owns the `[process=N]` prefix, and the parts that run threads: the
failure watchdog, the where-responder, the stall reports, the live
blocks and the step deadline (built with the runtime, by the assembler that
`multihost._src.api.assembly` registers: the parts' classes live in the
packages above this one), the TCP links (`transport.tcp.link.plane_of`,
made on the first transfer: they listen and publish an address) and, on
process 0, the coordination-service companion (set by `initialize()`).

`current()` is the process's runtime. Without `jax.distributed` it is a
local one (one process, no client); once `jax.distributed` is initialized
(by `multihost.initialize()` or by the program itself) the next `current()`
builds one on JAX's client, carrying over the settings. Tests build
runtimes of their own on an in-memory coordination service, one per thread
standing for a process, and pass them to the control plane.

`Runtime.shutdown` is the one exit sequence (registered once with atexit):
the where-responder stops, then the watchdog's exit handshake runs, then
the companion stops the service. It is registered after `import jax` and
after the backends started, so it runs before JAX's own atexit shutdown of
the distributed client and of the CPU collectives (see `liveness.watchdog`).
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
import functools
import itertools
import os
import threading
from typing import TYPE_CHECKING
from typing import Any

from absl import logging
import jax

from multihost._src.runtime import coordination
from multihost._src.runtime import errors
from multihost._src.runtime import flight
from multihost._src.runtime import settings as _settings

if TYPE_CHECKING:  # For annotations only: liveness sits above this package.
  from multihost._src.liveness import step_deadline as _step_deadline
  from multihost._src.liveness import watchdog as _watchdog

# The exit sequence (see `Runtime.shutdown`). The flight recorder's dump
# goes first: it only writes a local file, and a later step may block.
EXIT_ORDER = ('trace', 'where', 'handshake', 'companion')


class Logger:
  """absl logging with this process's `[process=N]` prefix on every line."""

  __slots__ = ('_runtime',)

  def __init__(self, runtime: Runtime):
    self._runtime = runtime

  @property
  def prefix(self) -> str:
    return self._runtime.prefix

  def info(self, message: str, *args: Any) -> None:
    logging.info('%s ' + message, self.prefix, *args)

  def warning(self, message: str, *args: Any) -> None:
    logging.warning('%s ' + message, self.prefix, *args)

  def error(self, message: str, *args: Any) -> None:
    logging.error('%s ' + message, self.prefix, *args)


class Runtime:
  """One process's multihost state (see the module docstring).

  Args:
    client: the coordination-service client, or None (one process).
    index: this process's index (None: JAX's, read when first needed).
    count: the process count (None: JAX's, read when first needed).
    recoverable: whether the service survives a process's death
      (`jax_enable_recoverability`); the watchdog runs only then.
    runs_service: whether this process runs the coordination service.
    service_address: 'host:port' of the coordination service.
    settings: the program's settings, carried over from an earlier runtime.
    raw: the object `current()` compares JAX's client with (JAX's own).
  """

  def __init__(self, client: coordination.Client | None, *,
               index: int | None = None, count: int | None = None,
               recoverable: bool = False, runs_service: bool = False,
               service_address: str | None = None,
               settings: _settings.Settings | None = None, raw: Any = None):
    self.client = client
    self._index = index
    self._count = count
    self._prefix = None if index is None else f'[process={index}]'
    self.recoverable = recoverable
    self.runs_service = runs_service
    self.service_address = service_address
    self.settings = settings or _settings.Settings()
    self.raw = raw
    self.lock = threading.Lock()  # Guards the creation of the TCP links.
    self.log = Logger(self)
    self.flight = flight.Recorder()
    self._calls = itertools.count()
    # The number of the collective call that started last (-1: none yet):
    # a transfer's data frames carry it (`transport.tcp.link.transfer_id`).
    self.call = -1
    # The job secret: (job id, secret), agreed once (see `auth.secret`).
    self.secret_lock = threading.Lock()
    self.job_keys: tuple[bytes, bytes] | None = None
    # The rendezvous' fast path (see `control.rendezvous`): calls left that
    # take the full exchange directly, and when the last call ended.
    self.backoff = 0
    self.last_end: float | None = None
    # When this process started its last call that every process met in (None
    # before the first, and after a call that raised): no process can have
    # started a later call before it, which bounds when another's timeout
    # can fall (`control.rounds`, the outcome record).
    self.met_start: float | None = None
    # The blocks of calls (`control.rendezvous._BLOCK`) under which this
    # process wrote keys, not yet deleted: each process deletes the keys it
    # wrote, so a call that agreed over the links, writing none, costs no
    # RPC.
    self.written_blocks: set[int] = set()
    # Whether calls agree through the service only, never over the links
    # (tests of that path set it).
    self.service_only = False
    # The exit sequence's steps, by name, set by the parts that need one;
    # `shutdown` runs them in EXIT_ORDER.
    self.exit_steps: dict[str, Callable[[], None]] = {}
    # The type of the uncaught exception ending the program, if any (noted
    # by `liveness.exit_handshake.note_uncaught_exceptions`, read by the exit handshake).
    self.uncaught: str | None = None
    # The TCP links (a `transport.tcp.link.Plane`), made on the first
    # transfer; process 0's companion (a `runtime.companion.Companion`).
    # Typed Any here and below: their classes are in the packages above
    # this one, which import it, never the other way.
    self.plane: Any = None
    self.companion: Any = None
    # The parts that run threads (which they start when first needed),
    # built now by the registered assembler: a `liveness.watchdog.Watchdog`,
    # a `diagnostics.where.Responder`, `diagnostics.stalls.Stalls`,
    # `api.live_devices.Blocks` and a `liveness.step_deadline.StepWatch`.
    self.watchdog: _watchdog.Watchdog
    self.where: Any
    self.stalls: Any
    self.live_blocks: Any
    self.step_watch: _step_deadline.StepWatch
    assemble = PROCESS.assembler
    if assemble is None:
      raise RuntimeError(
          'multihost\'s runtime parts are not assembled: import '
          'multihost._src.api (any public multihost function does) before '
          'making a Runtime.')
    assemble(self)

  @property
  def index(self) -> int:
    if self._index is None:
      return jax.process_index()
    return self._index

  @property
  def count(self) -> int:
    if self._count is None:
      return jax.process_count()
    return self._count

  @property
  def prefix(self) -> str:
    """'[process=N]', the start of every message of this process."""
    return self._prefix or f'[process={self.index}]'

  # --- The call counter --------------------------------------------------

  def next_call_id(self) -> int:
    """The number of the collective call about to start (0, 1, 2, ...)."""
    self.call = next(self._calls)
    return self.call

  def reset_calls(self, start: int) -> None:
    """Makes `start` the next call's number (every process must pass the same)."""
    self._calls = itertools.count(start)

  # --- Timeouts ----------------------------------------------------------

  def default_timeout(self) -> float:
    """The timeout, in seconds, used when a collective gets `timeout=None`."""
    return self.settings.timeout()

  def timeout_source(self, timeout: float) -> str:
    """What set `timeout`, as advice names it: 'setter', 'environment', 'default' or 'argument'.

    A value equal to the default timeout is taken to be the default (a
    collective passes on its resolved timeout, not whether it was given).
    """
    try:
      default = self.default_timeout()
    except ValueError:  # A bad $MULTIHOST_TIMEOUT: not what set this one.
      return 'argument'
    if timeout != default:
      return 'argument'
    if self.settings.default_timeout is not None:
      return 'setter'
    if _settings.timeout_is_set():
      return 'environment'
    return 'default'

  def resolve_timeout(self, timeout: float | None) -> float:
    if timeout is None:
      return self.default_timeout()
    if not timeout > 0:
      raise ValueError(
          f'timeout must be a positive number of seconds; got {timeout!r}.')
    return float(timeout)

  # --- The coordination service ------------------------------------------

  def service(self) -> coordination.Client:
    """This runtime's coordination-service client; raises NotInitializedError without one.

    For the parts that run only in a multi-process job (where `client` is
    never None): a None here is a bug or a missing `multihost.initialize()`.
    """
    if self.client is None:
      raise errors.NotInitializedError(
          f'{self.prefix} has no coordination-service client: jax.distributed '
          'is not initialized. Call multihost.initialize() (or '
          'jax.distributed.initialize()) at the start of your program.')
    return self.client

  # --- Leaving -----------------------------------------------------------

  def connected(self) -> bool:
    """Whether this runtime's client is still the live one (not shut down)."""
    if self.raw is not None:
      return self.raw is coordination.raw_client()
    return self.client is not None and getattr(self.client, 'connected', True)

  def disconnect(self) -> None:
    """Disconnects from the coordination service (ends calls in flight)."""
    if self.raw is not None:
      if self.raw is coordination.raw_client():
        jax.distributed.shutdown()
    elif self.client is not None and hasattr(self.client, 'disconnect'):
      self.client.disconnect()

  def dump_flight(self, folder: str) -> None:
    """Writes the flight recorder to `folder`/process-N.attempt-K.json (K: the launcher's restart count)."""
    attempt = _settings.restart_count()
    try:
      self.flight.dump(
          os.path.join(folder, f'process-{self.index}.attempt-{attempt}.json'),
          self.index, attempt=attempt, count=self.count)
    except Exception as e:  # noqa: BLE001  Exiting anyway: say why, go on.
      self.log.warning('Could not write the flight recorder to %s: %s. '
                       'The trace will mark this process as not dumped.',
                       folder, e)

  def shutdown(self) -> None:
    """The exit sequence: the trace dump, the where-responder, the watchdog's handshake, the companion.

    In this order: no thread of ours may be inside a key-value get when the
    watchdog's handshake disconnects, and process 0's companion may stop the
    service only once the others have left (which the handshake waits for).
    """
    for name in EXIT_ORDER:
      step = self.exit_steps.pop(name, None)
      if step is not None:
        step()


class Process:
  """This process's runtime, what builds its parts, and whether its exit sequence is registered.

  One instance, `PROCESS`, made at import: `current()`, `set_assembler()`
  and the rebuild replace its fields (under its lock); the module's names
  are never rebound.
  """

  __slots__ = ('assembler', 'runtime', 'exit_registered', 'lock')

  def __init__(self):
    self.assembler: Callable[[Runtime], None] | None = None
    self.runtime: Runtime | None = None
    self.exit_registered = False
    self.lock = threading.Lock()


PROCESS = Process()


def set_assembler(assemble: Callable[[Runtime], None]) -> None:
  """Registers what builds a new runtime's parts (`multihost._src.api.assembly.assemble`)."""
  PROCESS.assembler = assemble


def current() -> Runtime:
  """This process's runtime (a new one once `jax.distributed` has a new client)."""
  rt = PROCESS.runtime
  if rt is None or rt.raw is not coordination.raw_client():
    rt = _rebuild()
  return rt


def _rebuild() -> Runtime:
  with PROCESS.lock:
    raw = coordination.raw_client()
    old = PROCESS.runtime
    if old is not None and old.raw is raw:
      return old
    settings = None if old is None else old.settings
    if raw is None:
      rt = PROCESS.runtime = Runtime(None, settings=settings)
      return rt
    # Starts the backends (and their atexit finalizers) before ours is
    # registered, so that ours runs first.
    index, count = jax.process_index(), jax.process_count()
    rt = PROCESS.runtime = Runtime(
        coordination.JaxClient(raw), index=index, count=count,
        # JAX's options are attributes it makes at run time.
        recoverable=bool(jax.config.jax_enable_recoverability),  # type: ignore[attr-defined]
        runs_service=coordination.runs_service(),
        service_address=coordination.coordinator_address(),
        settings=settings, raw=raw)
    folder = _settings.trace_dir()
    if folder:  # `multihost.launch --trace` merges these dumps.
      rt.exit_steps['trace'] = functools.partial(rt.dump_flight, folder)
    if not PROCESS.exit_registered:
      atexit.register(_at_exit)
      PROCESS.exit_registered = True
    return rt


def _at_exit() -> None:
  rt = PROCESS.runtime
  if rt is not None:
    rt.shutdown()
