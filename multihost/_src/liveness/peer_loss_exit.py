"""Liveness: a survivor that cannot get control back leaves by itself.

When a peer dies while this process's main thread is inside a call that
Python cannot interrupt (a jitted step's gloo or NCCL collective waits
forever for the dead peer; see docs/failures.md), no exception can
reach the program. Our own collectives raise `ProcessFailureError`; anything
else would hold the job's allocation until someone kills it.

So once the watchdog has seen a peer fail, this process gets `grace` seconds
for the failure to be delivered: any multihost call that raises
`ProcessFailureError` to the program counts. If none has by then, the
process runs the user's `before_exit` hook (bounded), logs one line that
names the failed processes, the operation and where its main thread is,
flushes its logs, and leaves with `EXIT_STATUS`, so that a launcher (or a
scheduler's requeue) can restart the job.
"""

from __future__ import annotations

from collections.abc import Callable
import logging as std_logging
import os
import sys
import threading
import time

from absl import logging

# The exit status of a process that left because a peer failed (BSD's
# EX_TEMPFAIL: a temporary failure, the job may be retried).
EXIT_STATUS = 75
# Seconds between the watchdog seeing a failure and leaving. With the
# detection delay (heartbeat + about 1.5 s) this keeps the exit within
# heartbeat + 10 s of the death.
DEFAULT_GRACE_S = 7.0
# How long the user's hook may run before the process leaves regardless.
HOOK_TIMEOUT_S = 60.0


class PeerLossExit:
  """Decides whether, and when, this process leaves after a peer failure.

  One instance per process (owned by the watchdog). Thread-safe.
  """

  def __init__(self, *, exit_fn: Callable[[int], None] = os._exit,
               clock: Callable[[], float] = time.monotonic):
    self._exit_fn = exit_fn
    self._clock = clock
    self._cond = threading.Condition()
    self.enabled = True
    self.grace = DEFAULT_GRACE_S
    self.before_exit: Callable[[list[int]], None] | None = None
    self.hook_timeout = HOOK_TIMEOUT_S
    self._delivered = False
    self._cancelled = False
    self._thread: threading.Thread | None = None

  def configure(self, *, enabled: bool, grace: float | None = None,
                before_exit: Callable[[list[int]], None] | None = None,
                hook_timeout: float | None = None) -> None:
    """Sets the policy (see `multihost.set_exit_on_peer_failure`)."""
    if grace is not None and not grace >= 0:
      raise ValueError(f'grace must be a number of seconds >= 0; got {grace!r}.')
    if before_exit is not None and not callable(before_exit):
      raise TypeError('before_exit must be a callable taking the list of '
                      f'failed process indices; got {before_exit!r}.')
    with self._cond:
      self.enabled = bool(enabled)
      if grace is not None:
        self.grace = float(grace)
      self.before_exit = before_exit
      if hook_timeout is not None:
        self.hook_timeout = float(hook_timeout)
      self._cond.notify_all()

  def delivered(self) -> None:
    """A `ProcessFailureError` reached the program: it has control."""
    with self._cond:
      self._delivered = True
      self._cond.notify_all()

  def cancel(self) -> None:
    """The process is leaving anyway (normal exit): never act."""
    with self._cond:
      self._cancelled = True
      self._cond.notify_all()

  @property
  def armed(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def failure_seen(self, failed: list[int], *, prefix: str,
                   describe: Callable[[], str]) -> None:
    """Starts the countdown (once) after the watchdog saw `failed` die.

    Args:
      failed: the failed process indices.
      prefix: this process's log prefix (`[process=N]`).
      describe: renders where this process's main thread is and what it was
        doing (called only if the process leaves).
    """
    with self._cond:
      if self._thread is not None or self._delivered or self._cancelled:
        return
      self._thread = threading.Thread(
          target=self._countdown, args=(list(failed), prefix, describe),
          name='multihost-peer-loss-exit', daemon=True)
      self._thread.start()

  def _countdown(self, failed: list[int], prefix: str,
                 describe: Callable[[], str]) -> None:
    with self._cond:
      deadline = self._clock() + self.grace
      while not (self._delivered or self._cancelled):
        remaining = deadline - self._clock()
        if remaining <= 0:
          break
        self._cond.wait(min(remaining, 0.5))
        deadline = min(deadline, self._clock() + self.grace)
      if self._delivered or self._cancelled or not self.enabled:
        return
      hook = self.before_exit
      waited = self.grace
    if hook is not None:
      self._run_hook(hook, failed, prefix)
    try:
      where = describe()
    except Exception as e:  # noqa: BLE001  Leaving matters more.
      where = f'(where-report failed: {e})'
    logging.error(
        '%s multihost: leaving with exit status %d: process(es) %s failed, '
        'and for %.1f s no multihost call raised ProcessFailureError here, so '
        'the main thread is stuck in a call Python cannot interrupt (a device '
        'collective waiting for the dead peer). Restart the job (python -m '
        'multihost.launch --max_restarts=N does). %s', prefix, EXIT_STATUS,
        failed, waited, where)
    flush_logs()
    self._exit_fn(EXIT_STATUS)

  def _run_hook(self, hook: Callable[[list[int]], None], failed: list[int],
                prefix: str) -> None:
    """Runs the user's hook in a thread, for at most `hook_timeout` s."""
    outcome: list[BaseException] = []

    def run():
      try:
        hook(list(failed))
      except BaseException as e:  # noqa: BLE001  Reported, then we leave.
        outcome.append(e)

    thread = threading.Thread(target=run, name='multihost-before-exit',
                              daemon=True)
    thread.start()
    thread.join(self.hook_timeout)
    if thread.is_alive():
      logging.error('%s multihost: the before_exit hook did not return within '
                    '%.0f s; leaving without it.', prefix, self.hook_timeout)
    elif outcome:
      logging.error('%s multihost: the before_exit hook raised %s: %s', prefix,
                    type(outcome[0]).__name__, outcome[0])


def flush_logs() -> None:
  """Flushes every log handler and the standard streams (before an `os._exit`)."""
  for handler in list(std_logging.getLogger().handlers) + list(
      logging.get_absl_logger().handlers):
    try:
      handler.flush()
    except Exception:  # noqa: BLE001
      pass
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # noqa: BLE001
      pass
