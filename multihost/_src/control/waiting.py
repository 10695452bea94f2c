"""Control plane: a call's waiting over the TCP links: diagnosis after the window, late marks, and the timeout, settled in the call's outcome record.

`control.rounds.agree` waits through a `Wait`: between the socket's slices
it checks the watchdog, after `WINDOW_S` publishes this process's presence
(so a timeout names who is missing), arms the stall report and looks for
gave-up marks (`late`), and at the deadline settles the call in its outcome
record (`auth.marks.settle`; why, in `control.rounds`): given up, or, when a
process already completed it, waiting on for the frames on their way. `Due`
is the `Deadline` of the call's sends and reads that follows that decision.
"""

from __future__ import annotations

import threading
import time

from multihost._src.auth import marks as _control_marks
from multihost._src.diagnostics import stalls
from multihost._src.diagnostics import where
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime.deadline import Deadline

# After this long without completing, a waiting process starts its
# diagnosis (presence, stall report, gave-up marks); then every `_MARKS_S`
# it looks for gave-up marks again.
WINDOW_S = 1.0
_MARKS_S = 1.0


def slack(timeout: float) -> float:
  """How long after the last process arrives a call's frames may still be moving, for the outcome record (`agree`)."""
  return max(WINDOW_S, timeout / 4)


class Wait:
  """A call's waiting over the links: the watchdog, diagnosis after the window, the timeout (settled in the call's outcome record)."""

  def __init__(self, meeting, timeout: float):
    self.m = meeting
    self.timeout = timeout
    self.deadline = meeting.start + timeout
    self.diagnose_at = meeting.start + min(WINDOW_S, timeout / 2)
    self.marks_at: float | None = None
    self.stall: int | None = None
    self.lock = threading.Lock()  # The sender thread asks `due` too.
    self.gave_up = False
    self.extended = False  # Another process settled the call as done.

  def due(self, now: float) -> bool:
    """Whether this process gives the call up now: its deadline passed and the call's outcome record says given up.

    The first process to reach its deadline settles the call as given up,
    unless a process that completed it settled it as done first: then
    every process did arrive, the frames still owed are on their way, and
    this one waits on, once more the timeout (after which a peer hangs in
    the call's rounds: it gives up).
    """
    with self.lock:
      if now < self.deadline:
        return False
      if self.gave_up or self.extended:
        self.gave_up = True
        return True
      m = self.m
      try:
        decided, _ = _control_marks.settle(m.rt, m.op, m.prefix,
                                           _control_marks.GIVEN_UP)
      except errors.MultihostError:
        raise
      except Exception:  # noqa: BLE001  The service is gone: nobody settles.
        decided = _control_marks.GIVEN_UP
      m.wrote()
      if decided == _control_marks.DONE:
        self.extended = True
        self.deadline = now + self.timeout
        return False
      self.gave_up = True
      return True

  def slice(self) -> None:
    """Between socket slices: raises if a peer is gone, late, or the timeout passed."""
    m = self.m
    m.rt.watchdog.check(m.op)
    now = time.monotonic()
    if self.due(now):
      raise self.timed_out(now)
    if self.marks_at is None and now >= self.diagnose_at:
      m._publish(b'D', self.timeout)  # presence, for naming the missing
      self.stall = stalls.arm(
          m.op, started=m.start, until=self.deadline, runtime=m.rt,
          missing=lambda: _control_marks.absent(m.rt, m.op, m.prefix))
      self.marks_at = now
    if self.marks_at is not None and now >= self.marks_at:
      self.marks_at = now + _MARKS_S
      late(m, self.timeout)

  def timed_out(self, now: float) -> errors.MultihostError:
    m = self.m
    error = _control_marks.named(
        m.rt, TimeoutError('DEADLINE_EXCEEDED: the agreement over the links'),
        m.op, m.prefix, waited=now - m.start, timeout=self.timeout)
    if isinstance(error, errors.CollectiveTimeoutError) and not self.extended:
      # (After the call was settled as done, no latecomer is left to tell.)
      m.wrote()
      _control_marks.leave_mark(m.rt, m.op, m.prefix, m.start)
    return where.with_whereabouts(error, runtime=m.rt)

  def end(self) -> None:
    if self.stall is not None:
      stalls.disarm(self.stall, runtime=self.m.rt)


class Due(Deadline):
  """The `Deadline` of a call's sends and reads over the links: it expires when its `Wait` gives the call up, not merely at the first deadline."""

  __slots__ = ('wait',)

  def __init__(self, wait: Wait, *, idle=None):
    super().__init__(wait.m.op, wait.deadline, wait.m.rt.watchdog, idle=idle)
    self.wait = wait

  def expired(self) -> bool:
    due = self.wait.due(time.monotonic())
    self.at = self.wait.deadline
    return due

  def left(self) -> float:
    return max(self.wait.deadline - time.monotonic(), 0.0)


def late(meeting, timeout: float) -> None:
  """Raises `arrived_late` if processes already gave this call up."""
  marks = _control_marks.gave_up(meeting.rt, meeting.op, meeting.prefix)
  if marks:
    raise failures.arrived_late(
        meeting.op, me=meeting.me, waited=time.monotonic() - meeting.start,
        timeout=timeout,
        late_by=_control_marks.late_by(marks, meeting.start),
        source=meeting.rt.timeout_source(timeout))
