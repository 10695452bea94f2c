"""Diagnostics: stall reports, the one line a collective still waiting after a threshold logs, naming where the missing processes are.

For slow paths only (a lock, no RPC until a report is due). One daemon
thread per process (`multihost-stall`) sleeps until the earliest report is
due, asks the missing processes where they are (`diagnostics.where.ask`) and logs.
"""

from __future__ import annotations

from collections.abc import Callable
import threading
import time

from absl import logging

from multihost import env as _env
from multihost._src.diagnostics import where
from multihost._src.diagnostics import where_text
from multihost._src.runtime import failures
from multihost._src.runtime import runtime as _runtime
from multihost._src.runtime import settings as _settings


def set_stall_report_after(seconds: float | None) -> None:
  """Sets after how many seconds of waiting a collective logs where the missing processes are.

  Args:
    seconds: a number of seconds (0 turns stall reports off), or None to go
      back to $MULTIHOST_STALL_REPORT_AFTER (or 60 s when it is unset).
  """
  if seconds is not None and not seconds >= 0:
    raise ValueError(
        f'The stall report threshold must be >= 0 seconds (0: off); got '
        f'{seconds!r}. Pass None to fall back to '
        f'${_env.STALL_REPORT_AFTER} or {_settings.DEFAULT_STALL_REPORT_S:g} s.')
  _runtime.current().settings.stall_report_after = (
      None if seconds is None else float(seconds))


def stall_report_after(runtime: _runtime.Runtime | None = None) -> float:
  """Seconds a collective waits before it logs a stall report (0: never)."""
  rt = runtime or _runtime.current()
  return rt.settings.stall_report()


class Stalls:
  """One process's due stall reports and the thread that logs them."""

  def __init__(self, runtime: _runtime.Runtime):
    self.runtime = runtime
    self.cond = threading.Condition()
    self.due: dict[int, tuple] = {}  # token -> (when, after, op, missing)
    self.thread: threading.Thread | None = None
    self.next_token = 0

  def add(self, op: str, *, started: float, after: float,
          missing: Callable[[], list[int]]) -> int:
    with self.cond:
      token = self.next_token
      self.next_token += 1
      self.due[token] = (started + after, after, op, missing)
      if self.thread is None:
        self.thread = threading.Thread(target=self._report,
                                       name='multihost-stall', daemon=True)
        self.thread.start()
      self.cond.notify()
    return token

  def remove(self, token: int) -> None:
    with self.cond:
      self.due.pop(token, None)

  def _report(self) -> None:
    rt = self.runtime
    while True:
      with self.cond:
        while True:
          now = time.monotonic()
          due = [(t, s) for t, s in self.due.items() if s[0] <= now]
          if due:
            token, (_, after, op, missing) = due[0]
            del self.due[token]
            break
          wake = min((s[0] for s in self.due.values()), default=None)
          self.cond.wait(None if wake is None else wake - now)
      try:
        me = rt.index
        others = [p for p in missing() if p != me]
        reports = where.ask(others, runtime=rt) if others else {}
        current = rt.flight.in_progress()  # The call waiting (named).
        label = current.label() if current and current.op == op else op
        logging.warning('%s', where_text.stall_line(
            label, waited=after, reports=reports,
            timeout=where.ANSWER_WITHIN_S, me=me))
      except Exception as e:  # noqa: BLE001
        rt.log.warning('multihost: stall report failed: %s',
                       failures.shorten(e, 200))


def arm(op: str, *, started: float, until: float,
          missing: Callable[[], list[int]],
          runtime: _runtime.Runtime | None = None) -> int | None:
  """Arranges one stall report if the wait of `op` (started at `started`) lasts past the threshold.

  `until` is when the wait times out (time.monotonic()); `missing()`
  returns the processes that have not arrived. Returns a token for `disarm`,
  or None when no report can be due before the timeout.
  """
  rt = runtime or _runtime.current()
  after = stall_report_after(rt)
  if after <= 0 or started + after >= until or rt.client is None:
    return None
  return rt.stalls.add(op, started=started, after=after, missing=missing)


def disarm(token: int | None, *,
           runtime: _runtime.Runtime | None = None) -> None:
  """The wait of `arm`'s token ended (no report from now on)."""
  if token is None:
    return
  (runtime or _runtime.current()).stalls.remove(token)
