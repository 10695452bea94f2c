"""Public function: live_devices, JAX's fault-tolerance block, on the failure watchdog and timed barriers of the live processes.

`jax.experimental.multihost_utils.live_devices` (JAX 0.10.2) asks the
coordination service which processes are alive, yields their devices, and at
the block's exit raises `ProcessFailureError` on every process if one died.
It needs `jax_enable_recoverability` and, for a survivor stuck in a device
collective, GPU-only flags; on CPU/gloo a collective over a dead process's
device never returns. Here the same contract is kept with what `multihost`
already has:

* Who is alive: the failure watchdog (`liveness.watchdog`), which sees a SIGKILLed
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

from collections.abc import Iterable
import threading
import time
from typing import Literal

from absl import logging
import jax

from multihost._src.control import live_barrier
from multihost._src.diagnostics import where
from multihost._src.liveness import watchdog
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import process
from multihost._src.runtime import runtime as _runtime

_OP = live_barrier.OP

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
  return _Block(devices, process.resolve_timeout(timeout))


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
    me = process.process_index()
    devices = list(dict.fromkeys(
        [] if self._given is None else self._given))
    if not devices:
      raise ValueError(
          f'No devices provided. {failures.prefix(me)} {_OP}: pass the '
          'devices to run on, e.g. multihost.live_devices(jax.devices()).')
    processes = frozenset(d.process_index for d in devices)
    if me not in processes:
      raise ValueError(
          'Provided devices do not have any local devices. '
          f'{failures.prefix(me)} {_OP}: the devices given belong to '
          f'processes {sorted(processes)} only; every process that enters the '
          'block must pass at least one of its own devices (e.g. '
          'jax.devices()).')
    self._devices = sorted(devices, key=lambda d: d.id)
    if process.process_count() == 1:
      self.live = processes
      return self._devices
    _runtime.current().watchdog.ensure_started()
    where.ensure_started()
    if not _runtime.current().watchdog.watching():
      _warn_unwatched()
    # Numbered per set of processes: those of another set do not count
    # these blocks.
    with _runtime.current().live_blocks.lock:
      self._n = _runtime.current().live_blocks.blocks.get(processes, 0)
      _runtime.current().live_blocks.blocks[processes] = self._n + 1
    self._who = live_barrier.digest(processes)
    live, _ = live_barrier.meet(self._who, self._n, 'enter', processes,
                    timeout=self._timeout)
    previous = _runtime.current().live_blocks.last_live
    _runtime.current().live_blocks.last_live = live_barrier.merge(previous, processes, live)
    self.live = live
    gone = sorted((previous & processes) - live) if previous else []
    if gone:
      raise errors.ProcessFailureError(
          f'{failures.prefix(me)} {_OP}: process(es) {gone} are gone '
          '(the coordination service no longer sees them alive) since the '
          'previous live_devices block, so this block did not start (its '
          'body did not run) on any live process. The next block yields '
          f'the devices of processes {sorted(live)}. {_HANG_ADVICE}',
          operation=_OP, failed=gone,
          failed_devices=self._devices_of(gone))
    _runtime.current().live_blocks.active = self
    _start_warner()
    return [d for d in self._devices if d.process_index in live]

  def __exit__(self, exc_type, exc, tb) -> Literal[False]:
    _runtime.current().live_blocks.active = None
    if exc is not None and not isinstance(exc, Exception):
      return False  # KeyboardInterrupt, SystemExit: leave at once.
    if process.process_count() == 1:
      return False
    me = process.process_index()
    status = b'' if exc is None else (  # b'': nothing published
        f'{type(exc).__name__}: {failures.shorten(exc, 300)}'.encode())
    live, statuses = live_barrier.meet(self._who, self._n, 'exit', self.live,
                           timeout=self._timeout, status=status)
    _runtime.current().live_blocks.last_live = live_barrier.merge(_runtime.current().live_blocks.last_live, self.live, live)
    gone = sorted(self.live - live)
    if gone:
      raise errors.ProcessFailureError(
          f'{failures.prefix(me)} {_OP}: process(es) {gone} are gone '
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
      raise errors.MultihostError(
          f'{failures.prefix(me)} {_OP}: the block raised on process(es) '
          f'{sorted(raised)} ({what}), so it fails on every process: a '
          'live_devices block ends normally everywhere or nowhere. Handle '
          'the error there, or treat this block as not done.')
    return False

  def _devices_of(self, processes: list[int]) -> set[jax.Device]:
    return {d for d in self._devices if d.process_index in processes}


def _warn_unwatched() -> None:
  if _runtime.current().live_blocks.unwatched_warned:
    return
  _runtime.current().live_blocks.unwatched_warned = True
  logging.warning(
      '%s %s: failure detection is off (jax_enable_recoverability is off, or '
      'multihost.initialize(detect_failures=False)): when a process dies, JAX '
      'aborts the others at its heartbeat timeout, so no block can raise '
      'ProcessFailureError. Call multihost.initialize() at the start of the '
      'program.', failures.prefix(), _OP)


def _start_warner() -> None:
  with _runtime.current().live_blocks.lock:
    if _runtime.current().live_blocks.warner is None:
      _runtime.current().live_blocks.warner = threading.Thread(target=_warn, name='multihost-live',
                                       daemon=True)
      _runtime.current().live_blocks.warner.start()


def _warn() -> None:
  """Logs once per dead process when one dies while a block's body runs.

  The body may then be inside a device collective that never returns (gloo
  on CPU), and the block's exit, which would raise, is never reached: this
  line is all the user gets.
  """
  while True:
    time.sleep(watchdog.POLL_INTERVAL_S)
    block = _runtime.current().live_blocks.active
    if block is None:
      continue
    new = sorted((block.live & set(watchdog.failed_processes()))
                 - block.warned)
    if not new:
      continue
    block.warned.update(new)
    logging.error(
        '%s %s: process(es) %s died during block %d. The block raises '
        'ProcessFailureError at its end; if this process is inside a device '
        'collective over their devices (a jitted function on a mesh that '
        'holds them), that call never returns on CPU (gloo), and this '
        'process must be stopped from outside.', failures.prefix(),
        _OP, new, block._n)  # pylint: disable=protected-access
