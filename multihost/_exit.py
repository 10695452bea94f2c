"""Failure: the exit handshake, by which a process leaves the job without being reported failed or aborting the others.

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

The process running the service does not wait when this process is
leaving after an error (`_leaving_after_error`): its last collective or
watched step raised a timeout or a failure here (the peers it waited for
are stuck, late or gone), or the program is ending with an uncaught
exception. Waiting would hold the whole job for `shutdown_timeout` on a
peer that may never come; instead the service stops with this process, so
the others end at once (JAX's client aborts them) and a launcher reports
this process's error as the first.

`leave` is the watchdog's step of `Runtime.shutdown`; it reads the
watchdog's state (`rt.watchdog`) and makes no import of it. It first
cancels the watchdog's exit-on-peer-failure policy: the process is leaving
anyway.
"""

from __future__ import annotations

import os
import sys
import time

from multihost import _coordination
from multihost import _diagnostics
from multihost import _peer_loss_exit
from multihost import _runtime

# How long abandoned collectives get to return at exit.
_EXIT_GRACE_S = 5.0
# Where each process records a normal exit in the key-value store.
EXIT_DIR = 'multihost_exit/'
# How often process 0 looks again while it waits for the others.
_LOOK_S = 0.5


def exited_processes(client: _coordination.Client) -> list[int]:
  """The processes that recorded a normal exit (none if the store is gone)."""
  try:
    return [int(k.rsplit('/', 1)[1]) for k, _ in client.kv_dir(EXIT_DIR)]
  except Exception:  # noqa: BLE001
    return []


def leave(rt: _runtime.Runtime) -> None:
  """Leaves the job cleanly: records the exit; the process running the service waits for the others."""
  watchdog = rt.watchdog
  if watchdog is not None:
    watchdog.peer_loss.cancel()
  if watchdog is None or not watchdog.running or not rt.connected():
    return
  me = watchdog.me
  cut_short = False
  try:
    companion = rt.companion
    serving = rt.runs_service or (companion is not None and
                                   companion.alive())
    if serving:
      rt.client.kv_set(f'{EXIT_DIR}{me}', b'')
      error = _leaving_after_error(rt)
      if error is None:
        _wait_for_others_to_leave(rt)
      else:
        cut_short = _say_not_waiting(rt, error)
      watchdog.stop_polling()
    else:
      watchdog.stop_polling()
      rt.client.kv_set(f'{EXIT_DIR}{me}', b'')
    if not serving or watchdog.abandoned or watchdog.thread.is_alive():
      # Disconnect now: before process 0 goes, and to end our calls in
      # flight. (Otherwise JAX's own atexit does it.)
      rt.disconnect()
  except Exception as e:  # Never turn an exit into a hang.  # noqa: BLE001
    rt.log.warning('multihost: exit handshake failed: %s',
                   _diagnostics.shorten(e, 300))
  watchdog.stopping = True
  watchdog.running = False
  deadline = time.monotonic() + _EXIT_GRACE_S
  watchdog.thread.join(max(0.0, deadline - time.monotonic()))
  steps = list(watchdog.abandoned_steps)
  for step in steps:
    while not step.done and time.monotonic() < deadline:
      time.sleep(0.01)
  if watchdog.thread.is_alive() or not all(s.done for s in steps):
    rt.log.error('multihost: leaving with os._exit(1): a collective '
                 'abandoned after a peer failed is still running in C++, and '
                 'a normal exit would abort or hang on it.')
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
  if cut_short and rt.uncaught not in (None, 'KeyboardInterrupt'):
    # The service's own shutdown (JAX's atexit) would wait up to 5 s for
    # the connections of the peers it is about to abort. An uncaught
    # exception's exit status is 1, so this process can give it at once.
    rt.log.warning('multihost: leaving with exit status 1 (the uncaught %s) '
                   'without the coordination service\'s graceful shutdown.',
                   rt.uncaught)
    _peer_loss_exit.flush_logs()
    os._exit(1)


def _leaving_after_error(rt: _runtime.Runtime) -> str | None:
  """Why this process leaves after an error (see the module docstring), or None."""
  failed = rt.flight.last_failed()
  if failed is not None:
    return f'{failed.label()} raised {failed.error} here'
  step = rt.watchdog.step_failed
  if step is not None:
    return f'{step} raised here'
  if rt.uncaught is not None:
    return f'the program is ending with {rt.uncaught}'
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

  def hook(kind, value, tb):
    try:
      _runtime.current().uncaught = kind.__name__
    finally:
      previous(kind, value, tb)

  hook._multihost_notes = True  # pylint: disable=protected-access
  sys.excepthook = hook


def _say_not_waiting(rt: _runtime.Runtime, why: str) -> bool:
  """Logs that this process leaves before the others; whether any were still there."""
  watchdog = rt.watchdog
  with watchdog.cond:
    others = set(range(watchdog.count)) - {watchdog.me}
    still = sorted(others - watchdog.exited - set(watchdog.failed))
  if still:
    rt.log.warning('multihost: leaving without waiting for process(es) %s '
                   'to exit, because %s; the coordination service stops '
                   'with this process, and the JAX runtime aborts them.',
                   still, why)
  return bool(still)


def _wait_for_others_to_leave(rt: _runtime.Runtime) -> None:
  watchdog = rt.watchdog
  deadline = time.monotonic() + watchdog.shutdown_timeout
  others = set(range(watchdog.count)) - {watchdog.me}
  with watchdog.cond:
    while True:
      left = watchdog.exited | set(watchdog.failed)
      if (others <= left or watchdog.service_lost
          or not watchdog.thread.is_alive()):
        return
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        break
      watchdog.cond.wait(min(remaining, _LOOK_S))
  rt.log.warning('multihost: exiting after %.0f s although process(es) %s '
                 'have not exited; the JAX runtime will abort them when the '
                 'coordination service stops with this process.',
                 watchdog.shutdown_timeout, sorted(others - left))
