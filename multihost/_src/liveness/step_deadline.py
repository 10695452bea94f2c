"""Liveness: the step deadline, a thread per process that ends a training step stuck past its deadline, naming who is behind.

A peer that is alive but stuck (in its data loader, in user code) still
sends heartbeats, so the watchdog (`liveness.watchdog`) never sees it; the
other processes wait in the jitted step's cross-process collective, in C++,
forever and in silence. The program marks its steps (`StepWatch.step(n)`,
a context manager, around each step; `recovery`'s loop does it), and:

* The deadline is learned (`step_rule`: `Rule`, `Learner`): the first
  `warmup_steps` steps (compilation) are never judged; then a step's
  deadline is max(floor, multiple x the longest step since warm-up), so it
  grows with slower steps and never shrinks (the first judged step uses
  the shortest warm-up step). A fixed deadline, or none, can be set
  instead.
* A daemon thread (`multihost-step-deadline`, started at the first judged
  step on a process with peers) sleeps until the step in progress is due.
  When a step outlasts its deadline, it asks every process where it is
  (`diagnostics.where`, through the coordination service: the others'
  responder threads answer while their main threads are blocked; each
  report carries the process's place in its steps, `position`), names the
  processes behind the most advanced one and where each is, in one line
  (`step_report`), and leaves with the peer-loss exit status (75,
  `liveness.peer_loss_exit`) so that a launcher's `--max_restarts` or a
  scheduler restarts the job.
  The stuck process leaves too: its own step outlasts the deadline. A
  step that raises once past its deadline (its collective failed as the
  stuck peer left) waits for the thread's verdict, so the process leaves
  with 75 and the report, not on that error with another status.
* `StepWatch.arrived()` marks the point of the step from which a process
  waits for its peers (its batch is loaded): in the same step, a process
  short of it is behind one past it.
* `StepWatch.awaiting(n, ready)`: step n's result is still to be read
  (checked after step n+1's dispatch): while it is not ready, a process in
  step n+1 is stuck on step n, and its place and report name step n.
* `StepWatch.between()`: a loop that wants no unwatched gap (`recovery`'s
  does) marks the end of a step's own work with it instead of `end`: the
  step stays judged, its time running, through the program's code after
  it (callbacks, saves, logging) until the next `begin` ends it. A process
  stalled there (a blocking callback, a signal handler that never
  returns) outlasts its deadline like one stalled in the step; its report
  says it is between steps, and where (its stack). `end` closes the
  watched window where the loop ends.

Per step: two clock reads and two uncontended lock operations, nothing
sent, nothing growing. Every blocking operation of the thread has a bound.
"""

from __future__ import annotations

from collections.abc import Callable
import threading
import time
from typing import Any

from absl import logging

from multihost._src.liveness import peer_loss_exit
from multihost._src.liveness import step_report
from multihost._src.liveness import step_rule
from multihost._src.runtime import runtime as _runtime

# Where-reports: the others answer within this (`diagnostics.where`'s
# ANSWER_WITHIN_S plus slack); the thread stops waiting for them then.
ASK_BOUND_S = 4.0


# --- One process's watch ----------------------------------------------------


class _Step:
  """The context of one step (see `StepWatch.step`)."""

  __slots__ = ('_watch', '_n')

  def __init__(self, watch: StepWatch, n: int):
    self._watch = watch
    self._n = n

  def __enter__(self) -> _Step:
    self._watch.begin(self._n)
    return self

  def __exit__(self, kind, value, tb) -> None:
    self._watch.end(value)


class StepWatch:
  """This process's step deadline: marks steps, learns their times, and leaves when one is stuck.

  One per runtime (built by the assembler, `multihost.step_watch()`
  returns it). The step methods are for the program's training loop
  (one thread); the rest is thread-safe.

  Args:
    runtime: the runtime it belongs to.
    ask: where-reports of the given processes (None: no answer in time).
    describe: those reports in one sentence.
    leave: leaves the process with the given exit status.
    leave_report: leaves this process's where-report for the others, as
      it leaves at a stuck step (None: nothing left).
    left_reports: the where-reports that processes left so (by process).
    clock: seconds, monotonic.
  """

  def __init__(self, runtime: _runtime.Runtime, *,
               ask: Callable[[list[int]], dict[int, dict | None]],
               describe: Callable[[dict[int, dict | None]], str],
               leave: Callable[[int], None],
               leave_report: Callable[[dict], None] | None = None,
               left_reports: Callable[[], dict[int, dict]] | None = None,
               clock: Callable[[], float] = time.monotonic):
    self.runtime = runtime
    self._ask = ask
    self._describe = describe
    self._leave = leave
    self._leave_report = leave_report
    self._left_reports = left_reports
    self._forced = 0  # The serial of a step judged before its deadline.
    self._clock = clock
    # `_lock` is `_cond`'s own: the per-step methods take it directly (the
    # same mutual exclusion without the Condition's Python-level enter/exit).
    self._lock = threading.Lock()
    self._cond = threading.Condition(self._lock)
    self._rule: step_rule.Rule | None = None  # Resolved at the first step.
    self.learner = step_rule.Learner()
    # The step in progress (None between steps): its number, when it began,
    # its deadline (None: not judged), a serial number for the thread.
    self._n: int | None = None
    self._began = 0.0
    self._due: float | None = None
    self._serial = 0
    self._decided = 0  # The serial of the last step the thread judged.
    self._state = 'done'
    self._last: int | None = None  # The last step begun.
    # (n, ready, began): see `awaiting`.
    self._awaited: tuple[int, Callable[[], bool] | None, float] | None = None
    self._ended = 0.0  # When the last step ended.
    self._arrivals = False  # Whether the program marks arrivals.
    self._thread: threading.Thread | None = None
    self._stopping = False
    self.fired: str | None = None  # The line logged, once it fired.

  # --- The program's side ------------------------------------------------

  def step(self, n: int) -> _Step:
    """The context of step `n`: judged against the deadline while inside it.

    Use one per step, around everything the step does (loading its batch,
    the jitted step, reading its loss), and nothing else (saves and
    evaluations go outside):

        watch = multihost.step_watch()
        for n in range(start, steps):
          with watch.step(n):
            batch = next(loader)
            watch.arrived()  # Optional: from here on it waits for peers.
            state, loss = train_step(state, batch)
            float(loss)

    Raises (on entering):
      RuntimeError: a step is already in progress (steps do not nest).
      ValueError: $MULTIHOST_STEP_DEADLINE is not auto, off or a number.
    """
    return _Step(self, int(n))

  def arrived(self) -> None:
    """Marks that this process has its step's inputs: from here on it waits for its peers.

    Optional. In the report of a stuck step, a process short of this point
    of the step is behind those past it. Outside a step it does nothing.
    """
    self._lock.acquire()  # Not `with`: see `begin`.
    try:
      if self._n is not None and self._state == 'preparing':
        self._state = 'arrived'
        self._arrivals = True
    finally:
      self._lock.release()

  def awaiting(self, n: int | None,
               ready: Callable[[], bool] | None = None) -> None:
    """Marks that step `n`'s result is still to be read (None: read), e.g. to check step n after dispatching step n+1.

    Step n+1 is judged against its own deadline; while it is in progress
    and `ready()` is False (None: until marked read), this process is
    stuck on step `n`: its place (`position`) and a stuck step's report
    name step `n`, timed from its start (marked during step `n`; else from
    now). `ready` is called only then (from other threads): it must not
    block.
    """
    with self._lock:
      self._awaited = None if n is None else (
          int(n), ready, self._began if self._last == n else self._clock())

  def deadline(self) -> float | None:
    """Seconds the next step (or the one in progress) may take; None when not judged (off, or warming up)."""
    with self._cond:
      if self._n is not None:
        return self._due
      return self.learner.deadline(self.rule())

  def configure(self, rule: step_rule.Rule) -> None:
    """Sets the rule (what was learned stays); applies from the next step."""
    with self._cond:
      self._rule = rule
      self._cond.notify_all()

  def rule(self) -> step_rule.Rule:
    """The rule in force (resolved from the settings on first use)."""
    if self._rule is None:
      self._rule = step_rule.rule_of(self.runtime.settings)
    return self._rule

  def position(self) -> dict | None:
    """Where this process is in its steps (part of its where-report), or None before its first step."""
    with self._cond:
      if self._last is None:
        return None
      stuck = self._stuck_on()
      if stuck is not None and self._awaited is not None:
        return {'step': stuck, 'state': 'arrived',
                'for': self._clock() - self._awaited[2],
                'arrivals': self._arrivals, 'in': stuck + 1}
      since = (self._ended if self._n is None or self._state == 'between'
               else self._began)
      return {'step': self._last, 'state': self._state,
              'for': self._clock() - since, 'arrivals': self._arrivals}

  def stop(self) -> None:
    """Stops the thread (tests; a process's thread ends with it)."""
    with self._cond:
      self._stopping = True
      self._cond.notify_all()
    if self._thread is not None:
      self._thread.join(2.0)

  def begin(self, n: int) -> None:
    """Begins step `n` (`step(n)`'s entry, for a loop that cannot use a `with` block: `end` must follow).

    A step marked `between` ends here, completed (its time, until now,
    is learned from): the watched window has no gap.

    Raises:
      RuntimeError: a step is already in progress (steps do not nest).
      ValueError: $MULTIHOST_STEP_DEADLINE is not auto, off or a number.
    """
    # Outside the lock: may raise on a bad variable (resolved once).
    rule = self._rule or self.rule()
    # acquire/release, not `with self._lock:` (a third of its cost on
    # Python 3.11, where `with` looks up and binds the lock's methods).
    self._lock.acquire()
    try:
      if self._n is not None:
        if self._state == 'between':
          self.learner.observe(self._clock() - self._began, rule)
          self._n = None
      if self._n is not None:
        raise RuntimeError(
            f'{self.runtime.prefix} step_watch: step {n} began inside step '
            f'{self._n}; steps do not nest. End step {self._n} first (one '
            '`with watch.step(n):` per step).')
      now = self._clock()
      limit = self.learner.deadline(rule)
      self._n, self._last, self._began = n, n, now
      self._state = 'preparing'
      self._serial += 1
      self._due = limit
      if (limit is not None and self._thread is None and not self._stopping
          and self.runtime.client is not None):  # A client: maybe peers.
        self._start_thread()
    finally:
      self._lock.release()

  def between(self) -> None:
    """Marks that the step in progress has done its own work: until the next `begin` (or `end`), this process is in its code between steps, still judged.

    For a loop that leaves no gap unwatched (`recovery`'s): call it where
    `end` would go, and `end` once, where the loop ends. The step's
    deadline still runs: a process stuck after it (in a callback, a save,
    a signal handler) leaves as one stuck in it does, and its place reads
    'between steps'. Outside a step it does nothing.
    """
    self._lock.acquire()  # Not `with`: see `begin`.
    try:
      if self._n is not None:
        self._state, self._ended = 'between', self._clock()
    finally:
      self._lock.release()

  def end(self, error: BaseException | None = None) -> None:
    """Ends the step in progress (`step(n)`'s exit), completed unless it raised `error`."""
    completed = error is None
    self._lock.acquire()  # Not `with`: see `begin`.
    try:
      if self._n is None:
        return
      now = self._clock()
      due = self._due
      judging = (not completed and due is not None
                 and self._thread is not None and not self._stopping)
      if (judging and due is not None and now - self._began < due
          and self._left_reports is not None):
        # Raised before its deadline: after a peer that left at its own
        # (its window began earlier: it is the one stuck), it is judged now.
        self._lock.release()
        try:
          left = _bounded(self._left_reports, ASK_BOUND_S)
        finally:
          self._lock.acquire()
        if left and set(left) - {self.runtime.index} and self._n is not None:
          self._forced = self._serial
          now = self._began + due
      due = self._due
      if judging and due is not None and now - self._began >= due:
        # Raised past its deadline: typically the step's collective failed
        # as a stuck peer left. The thread is judging this step; its
        # verdict stands (it leaves with 75, naming who was behind), or
        # the process would end on that error with another status, racing
        # the report.
        self.runtime.log.warning(
            'multihost: step %d raised %s its deadline of %.3g s (%s: '
            '%.200s); the step deadline reports it.', self._n,
            'after a peer left at' if self._forced == self._serial else
            'past', self._due, type(error).__name__, error)
        serial, until = self._serial, now + ASK_BOUND_S + 1.0
        self._cond.notify_all()
        while self._decided != serial and self._clock() < until:
          self._cond.wait(0.05)
        now = self._clock()
      if completed:
        self.learner.observe(now - self._began, self._rule or self.rule())
      self._n, self._due, self._state, self._ended = None, None, 'done', now
    finally:
      self._lock.release()

  def _stuck_on(self) -> int | None:
    """The earlier step this process is stuck on (see `awaiting`), or None (with the lock held)."""
    if self._awaited is None or self._n is None:
      return None
    n, ready, _ = self._awaited
    try:
      if n != self._n - 1 or (ready is not None and ready()):
        return None
    except Exception:  # noqa: BLE001  E.g. a deleted array: not awaited.
      return None
    return n

  # --- The thread --------------------------------------------------------

  def _start_thread(self) -> None:
    """Starts the thread once (with `_cond` held), on a process with peers."""
    rt = self.runtime
    if rt.client is None or rt.count < 2:
      return
    self._thread = threading.Thread(target=self._watch,
                                    name='multihost-step-deadline',
                                    daemon=True)
    self._thread.start()

  def _watch(self) -> None:
    while True:
      with self._cond:
        while True:
          if self._stopping:
            return
          now = self._clock()
          if self._n is not None and self._due is not None:
            overdue = now - (self._began + self._due)
            if overdue >= 0 or self._forced == self._serial:
              stuck = (self._serial, self._n, self._began, self._due)
              break
            wait = -overdue
          else:  # A step that begins now is due no sooner than this.
            wait = self.learner.deadline(self.rule()) or 1.0
          self._cond.wait(max(wait, 0.01))
      done = self._overdue(*stuck)
      with self._cond:
        self._decided = stuck[0]
        self._cond.notify_all()
      if done:
        return

  def _overdue(self, serial: int, n: int, began: float,
               due: float) -> bool:
    """Step `n` outlasted its deadline: reports, and leaves if it is still in progress; returns whether the thread is done."""
    rt = self.runtime
    me = rt.index
    with self._cond:  # Stuck on an earlier step's result: that step.
      stuck = self._stuck_on()
      if (self._serial == serial and stuck is not None
          and self._awaited is not None):
        n, began = stuck, self._awaited[2]
    took = self._clock() - began
    reports = _bounded(lambda: self._ask(list(range(rt.count))), ASK_BOUND_S)
    if reports is None:
      reports = {p: None for p in range(rt.count) if p != me}
    with self._cond:
      still = self._serial == serial and self._n is not None
      forced = self._forced == serial
    leave_report = self._leave_report
    if still and reports.get(me) and leave_report is not None:
      # Before leaving: those who ask after this process has gone still
      # learn where it was.
      _bounded(lambda: leave_report(reports[me]), ASK_BOUND_S)
    if still and self._left_reports is not None:  # Those that left so.
      left = _bounded(self._left_reports, ASK_BOUND_S) or {}
      reports.update({p: {**(reports.get(p) or left[p]), 'left': True}
                      for p in left if p != me})
    with self._cond:
      rule = self.rule()
      why = self.learner.explain(rule)
    if not still:  # It ended while the others were asked: slow, not stuck.
      rt.log.warning(
          'multihost: step %d ran for over %.1f s, past its deadline of %.3g '
          's (%s), but ended: not leaving. Later deadlines learn from it.', n,
          took, due, why)
      return False
    line = step_report.report(rt.prefix, me, n, took=took, due=due, why=why,
                              reports=reports, describe=self._describe,
                              raised=forced)
    self.fired = line
    logging.error('%s', line)
    peer_loss_exit.flush_logs()
    self._leave(peer_loss_exit.EXIT_STATUS)
    return True


def _bounded(fn: Callable[[], Any], timeout: float) -> Any:
  """`fn()` run in a daemon thread, or None if it did not return (or raised) within `timeout` s."""
  out: list[Any] = []

  def run():
    try:
      out.append(fn())
    except Exception:  # noqa: BLE001  No report then; leaving matters more.
      pass

  thread = threading.Thread(target=run, name='multihost-step-deadline-ask',
                            daemon=True)
  thread.start()
  thread.join(timeout)
  return out[0] if out else None
