"""Liveness: the exit handshake, by which a process leaves the job without being reported failed or aborting the others.

With recoverability on, JAX's shutdown barrier no longer holds process 0
back, and when process 0 exits the coordination service goes with it and
the C++ client aborts every process still connected. So every other
process records its exit and disconnects at once, and process 0 (or the
process whose companion runs the service) waits, up to the watchdog's
`shutdown_timeout`, until its watchdog has seen every other process leave
or fail.

No thread of ours may still be inside a C++ call when the interpreter
finalizes: a daemon thread that returns from C++ then is unwound by force,
which aborts the process. Disconnecting ends the coordination-service
calls, and peers that leave end a gloo collective; if a thread is still
inside one a few seconds later, the process leaves with `os._exit(1)`.

The process running the service never waits for a peer known to be stuck
or late, and waits only briefly for the others, when it is leaving after an
error (`_leaving_after_error`): its last collective or watched step raised
a timeout (the processes it named are stuck or late; the others timed out
too, and get `_EXIT_GRACE_S` to leave) or a failure (the other survivors
see it too, within the watchdog's detection bound, and get that bound plus
`_EXIT_GRACE_S`), or the program is
ending with an uncaught exception (`_EXIT_GRACE_S`). Waiting the whole
`shutdown_timeout` would hold the job on a peer that may never come;
instead the service stops with this process, JAX's client aborts those
still there, and a launcher reports this process's error as the first.

`leave` is the watchdog's step of `Runtime.shutdown`; it asks the
watchdog (`rt.watchdog`, a `liveness.watchdog.Watchdog`) through its
methods and its `snapshot()`, and makes no import of it. It first cancels
the watchdog's exit-on-peer-failure policy: the process is leaving anyway.
"""

from __future__ import annotations

from collections.abc import Collection
import os
import sys
import time
from types import TracebackType

from multihost._src.liveness import peer_loss_exit
from multihost._src.runtime import coordination
from multihost._src.runtime import failures
from multihost._src.runtime import runtime

_EXIT_GRACE_S = 5.0
# Where each process records a normal exit in the key-value store.
EXIT_DIR = 'multihost_exit/'

# What a process records there: it leaves normally, or after an error.
_NORMAL, _AFTER_ERROR = b'', b'error'


def exited_processes(client: coordination.Client) -> dict[int, bool]:
  """The processes that recorded their exit, each with whether it left normally (none if the store is gone)."""
  try:
    return {int(k.rsplit('/', 1)[1]): v == _NORMAL
            for k, v in client.kv_dir(EXIT_DIR)}
  except Exception:  # noqa: BLE001
    return {}


def leave(rt: runtime.Runtime) -> None:
  """Leaves the job cleanly: records the exit; the process running the service waits for the others."""
  watchdog = rt.watchdog
  if watchdog is not None:
    watchdog.cancel_peer_loss()
  if watchdog is None or not watchdog.watching() or not rt.connected():
    return
  me = watchdog.snapshot().me
  cut_short = False
  try:
    client = rt.client
    if client is None:  # (`connected()` says there is one.)
      raise RuntimeError('the runtime has no coordination client')
    companion = rt.companion
    serving = rt.runs_service or (companion is not None and
                                   companion.alive())
    error = _leaving_after_error(rt)
    # A peer still inside a collective this process finished waits a little
    # for it after a normal exit (`liveness.blocking`), not after an error.
    kind = _NORMAL if error is None else _AFTER_ERROR
    if serving:
      client.kv_set(f'{EXIT_DIR}{me}', kind)
      if error is None:
        _wait_for_others_to_leave(rt, watchdog.shutdown_timeout())
      else:
        why, stuck, within = error
        # Peers that are not stuck leave soon (they raised too, or will):
        # waiting for them spares them JAX's abort.
        _wait_for_others_to_leave(rt, within, but=stuck, warn=False)
        cut_short = _say_not_waiting(rt, why)
      watchdog.stop_polling()
    else:
      watchdog.stop_polling()
      client.kv_set(f'{EXIT_DIR}{me}', kind)
    if not serving or watchdog.in_flight():
      # Disconnect now: before process 0 goes, and to end our calls in
      # flight. (Otherwise JAX's own atexit does it.)
      rt.disconnect()
  except Exception as e:  # Never turn an exit into a hang.  # noqa: BLE001
    rt.log.warning('multihost: exit handshake failed: %s',
                   failures.shorten(e, 300))
  if not watchdog.finish(time.monotonic() + _EXIT_GRACE_S):
    rt.log.error('multihost: leaving with os._exit(1): a collective '
                 'abandoned after a peer failed is still running in C++, and '
                 'a normal exit would abort or hang on it.')
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
  if (cut_short and rt.uncaught not in (None, 'KeyboardInterrupt') and
      rt.raw is not None):  # The process's own runtime, not a test's.
    # The service's own shutdown (JAX's atexit) would wait up to 5 s for
    # the connections of the peers it is about to abort. An uncaught
    # exception's exit status is 1, so this process can give it at once.
    rt.log.warning('multihost: leaving with exit status 1 (the uncaught %s) '
                   'without the coordination service\'s graceful shutdown.',
                   rt.uncaught)
    if rt.companion is not None:  # Its service stops as process 0's would.
      rt.companion.release()
    peer_loss_exit.flush_logs()
    os._exit(1)


def _leaving_after_error(rt: runtime.Runtime
                         ) -> tuple[str, set[int], float] | None:
  """Why this process leaves after an error (see the module docstring), or None.

  Returns:
    (why, the peers known to be stuck or late, how long to wait for the
    others), or None when it leaves normally.
  """
  watchdog = rt.watchdog
  failed = rt.flight.last_failed()
  if failed is not None:
    why = f'{failed.label()} raised {failed.error} here'
    if failed.missing:  # A timeout: the others timed out too.
      return why, set(failed.missing), _EXIT_GRACE_S
    # They see it too: within the detection bound (a peer that saw a link
    # break waits that long to learn whether a process failed), then leave.
    return why, set(), watchdog.detection_bound() + _EXIT_GRACE_S
  step_failed = watchdog.last_step_failed()
  if step_failed is not None:
    return (f'{step_failed} raised here', set(),
            watchdog.detection_bound() + _EXIT_GRACE_S)
  if rt.uncaught is not None:
    return f'the program is ending with {rt.uncaught}', set(), _EXIT_GRACE_S
  return None


def note_uncaught_exceptions() -> None:
  """Chains a `sys.excepthook` that notes, for the exit handshake, that the program ends with an exception.

  The interpreter calls it for an uncaught exception before the atexit
  handlers run. (Not `sys.last_value`: pytest sets it for every failed test,
  which is no reason for a worker to leave early.) Installed once.
  """
  previous = sys.excepthook
  if getattr(previous, '_multihost_notes', False):
    return

  def hook(kind: type[BaseException], value: BaseException,
           tb: TracebackType | None) -> None:
    try:
      runtime.current().uncaught = kind.__name__
    finally:
      previous(kind, value, tb)

  # Marks it: installed once. (A function's attribute, which mypy does not
  # model.)
  hook._multihost_notes = True  # type: ignore[attr-defined]
  sys.excepthook = hook


def _say_not_waiting(rt: runtime.Runtime, why: str) -> bool:
  """Logs that this process leaves before the others; whether any were still there."""
  still = rt.watchdog.snapshot().still_here()
  if still:
    rt.log.warning('multihost: leaving without waiting for process(es) %s '
                   'to exit, because %s; the coordination service stops '
                   'with this process, and the JAX runtime aborts them.',
                   still, why)
  return bool(still)


def _wait_for_others_to_leave(rt: runtime.Runtime, timeout: float, *,
                              but: Collection[int] = frozenset(),
                              warn: bool = True) -> None:
  """Waits up to `timeout` s until every other process (except `but`) left or failed."""
  still = rt.watchdog.wait_for_others_to_leave(timeout, but=but)
  if not still or not warn:
    return
  rt.log.warning('multihost: exiting after %.0f s although process(es) %s '
                 'have not exited; the JAX runtime will abort them when the '
                 'coordination service stops with this process.',
                 timeout, still)
