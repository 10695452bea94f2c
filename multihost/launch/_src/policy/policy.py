"""The run policy: the first failure stops the run (at once when a restart follows, else after a grace period), a timeout stops it all, stopping is SIGTERM then SIGKILL, a failed attempt may start again unless it said restarting will not help.

`next_step()` is the policy within one attempt as a pure function of what
has been observed; `supervise()` applies it to running `Processes` until
the attempt must end, and `stop()` / `forward()` end it. `after_attempt()`
is the pure restart decision between attempts (torchrun's
`--max-restarts`), and `not_retryable()` finds the controller that said
restarting will not help (`multihost.env.NO_RETRY_EXIT_STATUS`).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import signal
import time

from multihost import env as env_lib
from multihost.launch._src.processes import processes as _processes

# Longer than the default failure-detection time (10 s heartbeat timeout, see
# multihost.initialize), so survivors can raise ProcessFailureError and exit
# on their own before they are stopped.
DEFAULT_GRACE_PERIOD_S = 15.0
# How long stopped processes get between SIGTERM (or a forwarded signal) and
# SIGKILL.
DEFAULT_KILL_WAIT_S = 2.0
# The same when they are stopped for a restart (at most this): they cannot
# save collectively without the failed process anyway (what is committed, on
# shared storage or in the local tier, is already on disk), and a controller
# blocked in a collective does not run its SIGTERM handler.
RESTART_KILL_WAIT_S = 0.5
# Longest sleep between two looks at the processes (exits wake it sooner).
_MAX_PAUSE_S = 0.2

WAIT = 'wait'
ALL_EXITED = 'all exited'
INTERRUPTED = 'interrupted'
TIMED_OUT = 'timed out'
GRACE_OVER = 'grace period over'
# A process failed and the job will start again: stop the others now.
RESTART_NOW = 'restart now'

# What follows an attempt (`after_attempt`).
RESTART = 'restart'
END = 'end'


@dataclasses.dataclass(frozen=True)
class Step:
  """What the launcher does next: `action`, and for WAIT, how long; `running` at that moment."""
  action: str
  pause: float = 0.0
  running: tuple[int, ...] = ()


def check(*, grace_period: float, kill_wait: float, max_restarts: int) -> None:
  """Raises ValueError, saying what to pass, for a grace period, kill wait or restart count a run cannot have."""
  if grace_period < 0 or kill_wait < 0:
    raise ValueError(
        f'grace_period and kill_wait must be >= 0 seconds; got '
        f'grace_period={grace_period}, kill_wait={kill_wait}.')
  if not isinstance(max_restarts, int) or max_restarts < 0:
    raise ValueError(f'max_restarts must be an integer >= 0; got '
                     f'max_restarts={max_restarts!r}.')


def next_step(*, elapsed: float, returncodes: collections.abc.Sequence[int | None],
              end_times: collections.abc.Sequence[float | None],
              timeout: float | None, grace_period: float,
              interrupted: bool, restart_at_once: bool = False) -> Step:
  """The policy's decision, `elapsed` seconds into a run (times are seconds from its start).

  In order: every process exited -> ALL_EXITED; the launcher got a signal ->
  INTERRUPTED; past `timeout` -> TIMED_OUT; a failure (non-zero exit) while
  `restart_at_once` (restarts are left) -> RESTART_NOW, unless a failed
  process said restarting will not help (`NO_RETRY_EXIT_STATUS`: no restart
  follows, so the others get the grace period); `grace_period` after the
  first failure -> GRACE_OVER; else WAIT until the next deadline (at most
  0.2 s).
  """
  running = tuple(i for i, rc in enumerate(returncodes) if rc is None)
  if not running:
    return Step(ALL_EXITED)
  if interrupted:
    return Step(INTERRUPTED, running=running)
  if timeout is not None and elapsed >= timeout:
    return Step(TIMED_OUT, running=running)
  failed = [(rc, t) for rc, t in zip(returncodes, end_times, strict=True)
            if rc not in (None, 0) and t is not None]
  if restart_at_once and failed and not_retryable(returncodes) is None:
    return Step(RESTART_NOW, running=running)
  failed_at = [t for _, t in failed]
  grace_end = min(failed_at) + grace_period if failed_at else None
  if grace_end is not None and elapsed >= grace_end:
    return Step(GRACE_OVER, running=running)
  wake = [t for t in (timeout, grace_end) if t is not None]
  pause = _MAX_PAUSE_S if not wake else max(
      0.0, min(_MAX_PAUSE_S, min(wake) - elapsed))
  return Step(WAIT, pause=pause, running=running)


def restarts_left(*, restart_count: int, max_restarts: int) -> bool:
  """Whether a failure of attempt `restart_count` (0 first) is followed by a restart."""
  return restart_count < max_restarts


def not_retryable(returncodes: collections.abc.Sequence[int | None],
                  stopped: collections.abc.Collection[int] = (),
                  end_times: collections.abc.Sequence[float | None] = ()
                  ) -> int | None:
  """The process that said restarting will not help, or None.

  That is, the first one (by `end_times` when known, else by index) that
  exited with `NO_RETRY_EXIT_STATUS` by itself (not among `stopped`, the
  processes the launcher stopped).
  """
  said = [i for i, rc in enumerate(returncodes)
          if rc == env_lib.NO_RETRY_EXIT_STATUS and i not in stopped]
  if not said:
    return None

  def when(i: int) -> float:
    t = end_times[i] if i < len(end_times) else None
    return float('inf') if t is None else t

  return min(said, key=lambda i: (when(i), i))


def after_attempt(*, exit_code: int, timed_out: bool, interrupted: bool,
                  restart_count: int, max_restarts: int,
                  time_left: float | None = None,
                  no_retry: bool = False) -> str:
  """Whether the job starts again after an attempt ended: RESTART or END (torchrun's rule).

  END when the attempt succeeded (`exit_code` 0: every process exited 0),
  when the launcher was interrupted (a person or a scheduler stops the
  run), when the run's timeout passed (`timed_out`, or no `time_left`: it
  bounds all attempts together), when a process said restarting will not
  help (`no_retry`: it exited with `NO_RETRY_EXIT_STATUS`, see
  `not_retryable`), or when `max_restarts` restarts were made already
  (`restart_count`, the restarts before this attempt). Otherwise the
  attempt failed: RESTART.
  """
  if exit_code == 0 or interrupted or timed_out or no_retry:
    return END
  if time_left is not None and time_left <= 0:
    return END
  return (RESTART if restarts_left(restart_count=restart_count,
                                   max_restarts=max_restarts) else END)


def supervise(procs: _processes.Processes, *, timeout: float | None,
              grace_period: float,
              interrupt: collections.abc.Callable[[], int | None],
              restart_at_once: bool = False,
              tick: collections.abc.Callable[[], None] | None = None) -> Step:
  """Waits, applying `next_step`, until the run must end; returns that step (it stops nothing).

  Args:
    procs: the running processes.
    timeout: seconds for the whole run, from `procs.start_time`; None: no
      limit.
    grace_period: seconds the others get after the first failure.
    interrupt: returns the signal the launcher got, or None (polled; a
      signal handler sets it without taking locks).
    restart_at_once: a restart follows a failure (restarts are left): the
      first failure ends the attempt at once (`RESTART_NOW`).
    tick: called at every look at the processes (at least every 0.2 s),
      holding `procs.changed`.
  """
  while True:
    with procs.changed:
      step = next_step(
          elapsed=time.monotonic() - procs.start_time,
          returncodes=procs.returncodes_locked(),
          end_times=procs.end_times_locked(), timeout=timeout,
          grace_period=grace_period, interrupted=interrupt() is not None,
          restart_at_once=restart_at_once)
      if step.action != WAIT:
        return step
      if tick is not None:
        tick()
      procs.changed.wait(step.pause)


def stop(procs: _processes.Processes, *, kill_wait: float) -> None:
  """Stops every running process: SIGTERM to its group, SIGKILL `kill_wait` seconds later; reaps all."""
  procs.signal_running(signal.SIGTERM)
  procs.stop(wait=kill_wait)


def forward(procs: _processes.Processes, sig: int, *, wait: float,
            again: collections.abc.Callable[[], bool]) -> None:
  """Forwards the launcher's signal `sig`; the processes get `wait` seconds (or until `again()`) before SIGKILL.

  (A program may turn the signal into a clean, collective stop, e.g.
  `recovery` saves an agreed step on Ctrl-C.) A second signal to the
  launcher (`again()`) stops them at once.
  """
  procs.signal_running(sig)
  procs.stop(wait=wait, until=again)
