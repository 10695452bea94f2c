"""Public function: live_devices, JAX's fault-tolerance block, on the failure watchdog and timed barriers of the live processes.

`jax.experimental.multihost_utils.live_devices` (JAX 0.10.2) asks the
coordination service which processes are alive, yields their devices, and at
the block's exit raises `ProcessFailureError` on every process if one died.
It needs `jax_enable_recoverability` and, for a survivor stuck in a device
collective, GPU-only flags; on CPU/gloo a collective over a dead process's
device never returns. Here the same contract is kept with what `multihost`
already has:

* Who is alive: the failure watchdog (`_watchdog`), which sees a SIGKILLed
  peer within heartbeat timeout + ~1 s.
* The barrier: a coordination-service barrier over the live processes only
  (`wait_at_barrier(..., process_ids)`), waited in windows of `WINDOW_S`. A
  window that expires (a peer is late, or dead and not yet declared dead)
  is retried with the live set read again, so a death during the wait ends
  it within the watchdog's bound, and a late process joins the current
  instance of the barrier (the service numbers a reused id's instances).
  Every process leaves a barrier with the same live set, so all of them
  reach the same verdict.
* At entry, when the live set is smaller than at the previous block's end
  (a process died between blocks), the block does not start: every live
  process raises `ProcessFailureError` from the `with` line. So a body never
  runs on devices of a process already known dead, and the next block's
  devices are the live ones.
* At exit, every process publishes whether its body raised, beside the
  barrier; so either every process leaves normally, or every process raises
  (the failure, its own exception, or a `MultihostError` naming the process
  whose body raised): JAX's docstring promises that, its code keeps it only
  for process failures.

After a failure, `multihost`'s collectives over all processes keep raising
`ProcessFailureError` (they need every process); device code on the yielded
devices and further `live_devices` blocks go on.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections.abc import Iterable

from absl import logging
import jax

from multihost import _coordination
from multihost import _diagnostics
from multihost import _errors
from multihost import _process
from multihost import _runtime
from multihost import _secret
from multihost import _stalls
from multihost import _watchdog
from multihost import _where

_OP = 'live_devices'
_ROOT = 'multihost_live'
# One barrier window: the service checks barrier deadlines about once a
# second, so a shorter window would not notice a change sooner.
WINDOW_S = 1.0
# A barrier call that fails at once is retried after this long, not at once.
_RETRY_S = 0.1
# Barrier ids cycle over this many blocks: the service keeps every id it has
# seen, and a block's barrier is done before the id comes round again.
_IDS = 8
# Keys are grouped by this many blocks; a group is deleted two groups later.
_GROUP = 16
_MAC = 16  # bytes of HMAC-SHA256(job secret, key + status)

_HANG_ADVICE = (
    'Build meshes and shardings from the devices a live_devices block '
    'yields, not from jax.devices() or from a mesh made before the failure: '
    'on CPU (gloo) a device collective over a dead process\'s device never '
    'returns.')


class Blocks:
  """This process's blocks: their count, the last agreed live set, the one in progress.

  One per runtime (`of`).
  """

  def __init__(self):
    self.lock = threading.Lock()
    self.blocks: dict[frozenset[int], int] = {}  # per set of processes
    self.unwatched_warned = False
    self.last_live: frozenset[int] | None = None
    self.active: _Block | None = None
    self.warner: threading.Thread | None = None


def of(runtime: _runtime.Runtime | None = None) -> Blocks:
  """The blocks of `runtime` (default: the current one), made on first use."""
  rt = runtime or _runtime.current()
  blocks = rt.live_blocks
  if blocks is None:
    with rt.lock:
      if rt.live_blocks is None:
        rt.live_blocks = Blocks()
      blocks = rt.live_blocks
  return blocks


def live_devices(devices: Iterable[jax.Device], *,
                 timeout: float | None = None) -> _Block:
  """A block that runs on the live ones of `devices`; it ends normally everywhere or raises everywhere.

  Collective: every live process with a device in `devices` must enter the
  block, and leave it, in the same order as the others.

  Drop-in for `jax.experimental.multihost_utils.live_devices`:

      while True:
        try:
          with multihost.live_devices(jax.devices()) as devices:
            mesh = jax.make_mesh((len(devices),), ('i',), devices=devices)
            ...  # jitted code on `mesh`
        except multihost.ProcessFailureError as e:  # or JAX's class
          print('lost', e.failed_devices)

  The `with` statement is a barrier of the live processes with devices in
  `devices` (processes that died are left out), and yields the devices of
  the live ones, sorted by id. Its exit is another barrier, and atomic: if a
  process died during the block, every live one raises
  `ProcessFailureError` (also JAX's class of that name) whose
  `failed_devices` are the dead processes' devices in `devices`; if a body
  raised, that process re-raises its exception and every other one raises a
  `MultihostError` naming it; otherwise every process goes on. If a process
  died since the previous block's end, the block does not start: every live
  process raises `ProcessFailureError` at the `with` line, so no body runs on
  a dead process's devices.

  Failures are seen by `multihost`'s watchdog, so call
  `multihost.initialize()` (it turns on `jax_enable_recoverability`; without
  it JAX aborts the survivors). A block's body that is inside a device
  collective over a process that dies may never return on CPU (gloo): this
  process then logs an error saying so. Processes do not rejoin. Blocks
  are counted per set of processes of `devices`, so processes that have no
  device in a block need not enter it.

  Args:
    devices: the devices to run on (e.g. `jax.devices()`); at least one of
      them must be this process's.
    timeout: seconds each barrier (entry, exit) waits for the live
      processes (default: see `multihost.set_default_timeout`).

  Returns:
    A context manager; `with` yields the live devices.

  Raises:
    ValueError: `devices` is empty or holds no device of this process.
    ProcessFailureError: a process died during the block (at exit) or since
      the previous block (at entry).
    CollectiveTimeoutError: a live process did not reach the barrier in
      time (named, with where it is).
  """
  return _Block(devices, _process.resolve_timeout(timeout))


class _Block:
  """One `with live_devices(...)` block (see `live_devices`)."""

  def __init__(self, devices: Iterable[jax.Device], timeout: float):
    self._given = devices
    self._timeout = timeout
    self._devices: list[jax.Device] = []
    self._n = -1
    self._who = ''
    self.live: frozenset[int] = frozenset()
    self.warned: set[int] = set()

  def __enter__(self) -> list[jax.Device]:
    me = _process.process_index()
    devices = list(dict.fromkeys(
        [] if self._given is None else self._given))
    if not devices:
      raise ValueError(
          f'No devices provided. {_diagnostics.prefix(me)} {_OP}: pass the '
          'devices to run on, e.g. multihost.live_devices(jax.devices()).')
    processes = frozenset(d.process_index for d in devices)
    if me not in processes:
      raise ValueError(
          'Provided devices do not have any local devices. '
          f'{_diagnostics.prefix(me)} {_OP}: the devices given belong to '
          f'processes {sorted(processes)} only; every process that enters the '
          'block must pass at least one of its own devices (e.g. '
          'jax.devices()).')
    self._devices = sorted(devices, key=lambda d: d.id)
    if _process.process_count() == 1:
      self.live = processes
      return self._devices
    _watchdog.of().ensure_started()
    _where.ensure_started()
    if not _watchdog.of().running:
      _warn_unwatched()
    # Numbered per set of processes: those of another set do not count
    # these blocks.
    with of().lock:
      self._n = of().blocks.get(processes, 0)
      of().blocks[processes] = self._n + 1
    self._who = _digest(processes)
    live, _ = _meet(self._who, self._n, 'enter', processes,
                    timeout=self._timeout)
    previous = of().last_live
    of().last_live = _merge(previous, processes, live)
    self.live = live
    gone = sorted((previous & processes) - live) if previous else []
    if gone:
      raise _errors.ProcessFailureError(
          f'{_diagnostics.prefix(me)} {_OP}: process(es) {gone} are gone '
          '(the coordination service no longer sees them alive) since the '
          'previous live_devices block, so this block did not start (its '
          'body did not run) on any live process. The next block yields '
          f'the devices of processes {sorted(live)}. {_HANG_ADVICE}',
          operation=_OP, failed=gone,
          failed_devices=self._devices_of(gone))
    of().active = self
    _start_warner()
    return [d for d in self._devices if d.process_index in live]

  def __exit__(self, exc_type, exc, tb) -> bool:
    of().active = None
    if exc is not None and not isinstance(exc, Exception):
      return False  # KeyboardInterrupt, SystemExit: leave at once.
    if _process.process_count() == 1:
      return False
    me = _process.process_index()
    status = b'' if exc is None else (  # b'': nothing published
        f'{type(exc).__name__}: {_diagnostics.shorten(exc, 300)}'.encode())
    live, statuses = _meet(self._who, self._n, 'exit', self.live,
                           timeout=self._timeout, status=status)
    of().last_live = _merge(of().last_live, self.live, live)
    gone = sorted(self.live - live)
    if gone:
      raise _errors.ProcessFailureError(
          f'{_diagnostics.prefix(me)} {_OP}: process(es) {gone} are gone '
          '(the coordination service no longer sees them alive): they '
          'failed during this block, and every live process raises this at '
          'its end. The next block yields the devices of processes '
          f'{sorted(live)}. {_HANG_ADVICE}',
          operation=_OP, failed=gone,
          failed_devices=self._devices_of(gone)) from exc
    if exc is not None:
      return False  # Its own exception; the others raise the error below.
    raised = {p: s for p, s in statuses.items() if s and p != me}
    if raised:
      what = '; '.join(f'process {p}: {s.decode(errors="replace")}'
                       for p, s in sorted(raised.items()))
      raise _errors.MultihostError(
          f'{_diagnostics.prefix(me)} {_OP}: the block raised on process(es) '
          f'{sorted(raised)} ({what}), so it fails on every process: a '
          'live_devices block ends normally everywhere or nowhere. Handle '
          'the error there, or treat this block as not done.')
    return False

  def _devices_of(self, processes: list[int]) -> set[jax.Device]:
    return {d for d in self._devices if d.process_index in processes}


def _merge(previous: frozenset[int] | None, asked: frozenset[int],
           live: frozenset[int]) -> frozenset[int]:
  """The known live set: `live` for the processes `asked` about, `previous` for the rest."""
  return live | ((previous or frozenset()) - asked)


def _meet(who: str, n: int, phase: str, candidates: frozenset[int], *,
          timeout: float, status: bytes = b''
          ) -> tuple[frozenset[int], dict[int, bytes]]:
  """The barrier of block `n` (of the processes `who`) at `phase`, over the live `candidates`; returns (who met, each one's status).

  Collective: every live process of `candidates` must call this, in the
  same order.

  Raises:
    CollectiveTimeoutError: a live process did not arrive within `timeout`
      (named, with where it is), or this one came after the others gave up.
  """
  me = _process.process_index()
  start = time.monotonic()
  deadline = start + timeout
  group = f'{_ROOT}/{who}/{n // _GROUP}/'
  statuses_dir = f'{group}{n}/{phase}/'  # a status for each body that raised
  here = f'{group}{n}/{phase}.here/'  # who waits, once a window expired
  gave_up = f'{group}{n}/{phase}.gave-up/'
  if (phase == 'enter' and n % _GROUP == 0 and n >= 2 * _GROUP
      and me == min(candidates)):
    # Nobody reads that group now.
    _coordination.kv_delete(f'{_ROOT}/{who}/{n // _GROUP - 2}/')
  secret = _secret.job_secret(_OP, timeout=timeout)
  if status:
    key = statuses_dir + str(me)
    _coordination.kv_set(key, _mac(secret, key, status) + status)
  stall = None
  while True:
    live = frozenset(candidates - set(_watchdog.failed_processes())) | {me}
    remaining = deadline - time.monotonic()
    if remaining <= 0:
      _stalls.disarm(stall)
      missing = sorted(live - _published(here, live))
      try:  # Who this process gave up on, for those still waiting.
        _coordination.kv_set(gave_up + str(me),
                             ','.join(map(str, missing)).encode())
      except Exception:  # noqa: BLE001  The service may be gone.
        pass
      raise _where.with_whereabouts(_timed_out(phase, n, missing,
                                               time.monotonic() - start,
                                               timeout))
    attempt = time.monotonic()
    try:
      _coordination.wait_at_barrier(_barrier_id(who, phase, n, live),
                                    min(WINDOW_S, remaining), sorted(live))
      break
    except Exception:  # The client raises JaxRuntimeError.  # noqa: BLE001
      pass  # A window passed (or the live sets differed): look again.
    if stall is None:  # The slow path: say who is here, watch for a stall.
      _coordination.kv_set(here + str(me), b'')
      stall = _stalls.arm(
          f'{_OP} ({phase} of block {n})', started=start, until=deadline,
          missing=lambda: sorted(live - _published(here, live)))
    given_up_on = _given_up_on(gave_up)
    if given_up_on is not None:  # Another process timed out: so does this.
      _stalls.disarm(stall)
      waited = time.monotonic() - start
      if me in given_up_on:  # It gave up on this one: it came too late.
        raise _diagnostics.arrived_late(f'{_OP} ({phase} of block {n})',
                                        me=me, waited=waited, timeout=timeout)
      raise _where.with_whereabouts(_timed_out(
          phase, n, sorted(given_up_on), waited, timeout))
    time.sleep(max(0.0, _RETRY_S - (time.monotonic() - attempt)))
  _stalls.disarm(stall)
  statuses = {}
  if phase == 'exit':  # Every status was published before the barrier.
    for k, stored in _coordination.kv_dir(statuses_dir):
      p = _process_of(k, statuses_dir)
      if p in live:
        value = stored[_MAC:]
        if not hmac.compare_digest(stored[:_MAC], _mac(secret, k, value)):
          raise _diagnostics.forged_message(_OP, k)
        statuses[p] = value
  return live, statuses


def _digest(processes: frozenset[int]) -> str:
  return hashlib.sha256(repr(sorted(processes)).encode()).hexdigest()[:12]


def _barrier_id(who: str, phase: str, n: int, live: frozenset[int]) -> str:
  """The barrier of block `n` of `who` at `phase` among `live`.

  The service fixes a barrier id's processes at its first use (another set
  is refused), so the id names the set: processes that see different live
  sets wait at different barriers, and retry once their views agree.
  """
  return f'{_ROOT}/{who}/{phase}/{n % _IDS}/{_digest(live)}'


def _mac(secret: bytes, key: str, value: bytes) -> bytes:
  return hmac.digest(secret, key.encode() + b'\0' + value,
                     hashlib.sha256)[:_MAC]


def _process_of(key: str, prefix: str) -> int | None:
  rest = key[len(prefix):]
  return int(rest) if key.startswith(prefix) and rest.isdigit() else None


def _given_up_on(gave_up: str) -> frozenset[int] | None:
  """The processes given up on by those that timed out; None if none did."""
  marks = _coordination.kv_dir(gave_up)
  if not marks:
    return None
  return frozenset(int(p) for _, value in marks
                   for p in value.decode().split(',') if p.isdigit())


def _published(prefix: str, live: frozenset[int]) -> frozenset[int]:
  """The processes of `live` with a key under `prefix` (none if the store is gone)."""
  try:
    return frozenset(p for k, _ in _coordination.kv_dir(prefix)
                     if (p := _process_of(k, prefix)) in live)
  except Exception:  # noqa: BLE001
    return frozenset()


def _timed_out(phase: str, n: int, missing: list[int], waited: float,
               timeout: float) -> _errors.CollectiveTimeoutError:
  where = 'start' if phase == 'enter' else 'end'
  return _errors.CollectiveTimeoutError(
      f'{_diagnostics.prefix()} {_OP}: timed out after {waited:.1f} s '
      f'(timeout={timeout:g} s) at the {where} of block {n}, waiting for '
      f'process(es) {missing}, which the coordination service still sees '
      f'alive. A process may be stuck in the block\'s body (e.g. in a device '
      f'collective over a dead process\'s device) or slow. '
      f'{_diagnostics.SAME_ORDER}, or {_diagnostics.LARGER_TIMEOUT}.',
      operation=_OP, missing=missing, waited=waited)


def _warn_unwatched() -> None:
  if of().unwatched_warned:
    return
  of().unwatched_warned = True
  logging.warning(
      '%s %s: failure detection is off (jax_enable_recoverability is off, or '
      'multihost.initialize(detect_failures=False)): when a process dies, JAX '
      'aborts the others at its heartbeat timeout, so no block can raise '
      'ProcessFailureError. Call multihost.initialize() at the start of the '
      'program.', _diagnostics.prefix(), _OP)


def _start_warner() -> None:
  with of().lock:
    if of().warner is None:
      of().warner = threading.Thread(target=_warn, name='multihost-live',
                                       daemon=True)
      of().warner.start()


def _warn() -> None:
  """Logs once per dead process when one dies while a block's body runs.

  The body may then be inside a device collective that never returns (gloo
  on CPU), and the block's exit, which would raise, is never reached: this
  line is all the user gets.
  """
  while True:
    time.sleep(_watchdog.POLL_INTERVAL_S)
    block = of().active
    if block is None:
      continue
    new = sorted((block.live & set(_watchdog.failed_processes()))
                 - block.warned)
    if not new:
      continue
    block.warned.update(new)
    logging.error(
        '%s %s: process(es) %s died during block %d. The block raises '
        'ProcessFailureError at its end; if this process is inside a device '
        'collective over their devices (a jitted function on a mesh that '
        'holds them), that call never returns on CPU (gloo), and this '
        'process must be stopped from outside.', _diagnostics.prefix(),
        _OP, new, block._n)  # pylint: disable=protected-access
