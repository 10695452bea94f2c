"""Liveness: the step deadline, a thread per process that ends a training step stuck past its deadline, naming who is behind.

A peer that is alive but stuck (in its data loader, in user code) still
sends heartbeats, so the watchdog (`liveness.watchdog`) never sees it; the
other processes wait in the jitted step's cross-process collective, in C++,
forever and in silence. The program marks its steps (`StepWatch.step(n)`,
a context manager, around each step; `recovery`'s loop does it), and:

* The deadline is learned (`Rule`, `Learner`): the first `warmup_steps`
  steps (compilation) are never judged; then a step's deadline is
  max(floor, multiple x the longest step since warm-up), so it grows with
  slower steps and never shrinks (the first judged step uses the shortest
  warm-up step). A fixed deadline, or none, can be set instead.
* A daemon thread (`multihost-step-deadline`, started at the first judged
  step on a process with peers) sleeps until the step in progress is due.
  When a step outlasts its deadline, it asks every process where it is
  (`diagnostics.where`, through the coordination service: the others'
  responder threads answer while their main threads are blocked; each
  report carries the process's place in its steps, `position`), names the
  processes behind the most advanced one and where each is, in one line,
  and leaves with the peer-loss exit status (75, `liveness.peer_loss_exit`)
  so that a launcher's `--max_restarts` or a scheduler restarts the job.
  The stuck process leaves too: its own step outlasts the deadline.
* `StepWatch.arrived()` marks the point of the step from which a process
  waits for its peers (its batch is loaded): in the same step, a process
  short of it is behind one past it.

Per step: two clock reads and two uncontended lock operations, nothing
sent, nothing growing. Every blocking operation of the thread has a bound.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import threading
import time
from typing import Any

from absl import logging

from multihost import env as _env
from multihost._src.liveness import peer_loss_exit
from multihost._src.runtime import runtime as _runtime
from multihost._src.runtime import settings as _settings

DEFAULT_WARMUP_STEPS = 3
DEFAULT_MULTIPLE = 5.0
DEFAULT_FLOOR_S = 60.0
# Where-reports: the others answer within this (`diagnostics.where`'s
# ANSWER_WITHIN_S plus slack); the thread stops waiting for them then.
ASK_BOUND_S = 4.0
# Where a step stands, in order: a process at a smaller (step, place) is
# behind one at a larger.
_PLACES = {'preparing': 0, 'arrived': 1, 'done': 2}


# --- The rule and what it learned (pure) ------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
  """How a step's deadline is set: learned (the default), fixed, or off.

  Attributes:
    enabled: False: no step is ever judged.
    fixed: seconds every judged step gets; None: learned.
    warmup_steps: the first steps a watch sees, never judged (compilation).
    multiple: a learned deadline is this many times the longest step.
    floor: a learned deadline is at least this many seconds.
  """
  enabled: bool = True
  fixed: float | None = None
  warmup_steps: int = DEFAULT_WARMUP_STEPS
  multiple: float = DEFAULT_MULTIPLE
  floor: float = DEFAULT_FLOOR_S

  def __post_init__(self):
    fix = ('multihost.set_step_deadline(fixed=SECONDS) or learned '
           '(warmup_steps=N >= 0, multiple >= 1, floor > 0)')
    if self.fixed is not None and not self.fixed > 0:
      raise ValueError(f'A fixed step deadline must be a positive number of '
                       f'seconds; got {self.fixed!r}. Pass {fix}, or '
                       'enabled=False to turn it off.')
    if (isinstance(self.warmup_steps, bool)
        or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0):
      raise ValueError(f'warmup_steps must be an int >= 0; got '
                       f'{self.warmup_steps!r}. Pass {fix}.')
    if not self.multiple >= 1:
      raise ValueError(f'multiple must be >= 1 (a step may take this many '
                       f'times the longest one seen); got {self.multiple!r}. '
                       f'Pass {fix}.')
    if not self.floor > 0:
      raise ValueError(f'floor must be a positive number of seconds; got '
                       f'{self.floor!r}. Pass {fix}.')


class Learner:
  """The step times a watch has seen, and the deadline they give under a `Rule`.

  Keeps three numbers, whatever the number of steps.
  """

  def __init__(self):
    self.steps = 0  # Completed steps seen (warm-up ones included).
    self.shortest_warmup: float | None = None
    self.longest: float | None = None  # Of the steps after the warm-up.

  def observe(self, seconds: float, rule: Rule) -> None:
    """One step completed in `seconds`."""
    if self.steps < rule.warmup_steps:
      if self.shortest_warmup is None or seconds < self.shortest_warmup:
        self.shortest_warmup = seconds
    elif self.longest is None or seconds > self.longest:
      self.longest = seconds
    self.steps += 1

  def deadline(self, rule: Rule) -> float | None:
    """Seconds the next step may take, or None when it is not judged (off, or warming up)."""
    if not rule.enabled or self.steps < rule.warmup_steps:
      return None
    if rule.fixed is not None:
      return rule.fixed
    basis = self.longest if self.longest is not None else self.shortest_warmup
    return max(rule.floor, rule.multiple * (basis or 0.0))

  def explain(self, rule: Rule) -> str:
    """How `deadline(rule)` came about, for the report."""
    if rule.fixed is not None:
      return 'fixed'
    if self.longest is not None:
      basis = f'the longest step after the warm-up, {self.longest:.3g} s'
    elif self.shortest_warmup is not None:
      basis = (f'the shortest of the {rule.warmup_steps} warm-up steps, '
               f'{self.shortest_warmup:.3g} s')
    else:
      basis = 'no step seen'
    return (f'learned: {rule.multiple:g} x {basis}, at least the floor of '
            f'{rule.floor:g} s')


def rule_of(settings: _settings.Settings) -> Rule:
  """The program's rule (`set_step_deadline`), else $MULTIHOST_STEP_DEADLINE's, else the default."""
  if settings.step_deadline is not None:
    return settings.step_deadline
  seconds = _settings.step_deadline()
  if seconds is None:
    return Rule()
  if seconds == 0:
    return Rule(enabled=False)
  return Rule(fixed=seconds)


def place(position: dict | None) -> tuple[int, int] | None:
  """A where-report's step position as an order: a smaller one is behind."""
  if not position:
    return None
  return (position['step'], _PLACES[position['state']])


def position_text(position: dict, *, arrivals: bool | None = None) -> str:
  """A step position in words: 'in step 5 for 3.1 s, not arrived at its collective part'.

  Args:
    position: a where-report's step position (`StepWatch.position`).
    arrivals: whether the program marks arrivals (`StepWatch.arrived`);
      None: whether this process has marked one.
  """
  n, state, seconds = position['step'], position['state'], position['for']
  if state == 'done':
    return f'between steps: step {n} ended {seconds:.1f} s ago'
  text = f'in step {n} for {seconds:.1f} s'
  if position['arrivals'] if arrivals is None else arrivals:
    text += (', arrived at its collective part' if state == 'arrived' else
             ', not arrived at its collective part')
  return text


# --- One process's watch ----------------------------------------------------


class _Step:
  """The context of one step (see `StepWatch.step`)."""

  __slots__ = ('_watch', '_n')

  def __init__(self, watch: StepWatch, n: int):
    self._watch = watch
    self._n = n

  def __enter__(self) -> _Step:
    self._watch._begin(self._n)  # pylint: disable=protected-access
    return self

  def __exit__(self, kind, value, tb) -> None:
    self._watch._end(completed=kind is None)  # pylint: disable=protected-access


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
    clock: seconds, monotonic.
  """

  def __init__(self, runtime: _runtime.Runtime, *,
               ask: Callable[[list[int]], dict[int, dict | None]],
               describe: Callable[[dict[int, dict | None]], str],
               leave: Callable[[int], None],
               clock: Callable[[], float] = time.monotonic):
    self.runtime = runtime
    self._ask = ask
    self._describe = describe
    self._leave = leave
    self._clock = clock
    self._cond = threading.Condition(threading.Lock())
    self._rule: Rule | None = None  # Resolved at the first step.
    self.learner = Learner()
    # The step in progress (None between steps): its number, when it began,
    # its deadline (None: not judged), a serial number for the thread.
    self._n: int | None = None
    self._began = 0.0
    self._due: float | None = None
    self._serial = 0
    self._state = 'done'
    self._last: int | None = None  # The last step begun.
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
    with self._cond:
      if self._n is not None and self._state == 'preparing':
        self._state = 'arrived'
        self._arrivals = True

  def deadline(self) -> float | None:
    """Seconds the next step (or the one in progress) may take; None when not judged (off, or warming up)."""
    with self._cond:
      if self._n is not None:
        return self._due
      return self.learner.deadline(self.rule())

  def configure(self, rule: Rule) -> None:
    """Sets the rule (what was learned stays); applies from the next step."""
    with self._cond:
      self._rule = rule
      self._cond.notify_all()

  def rule(self) -> Rule:
    """The rule in force (resolved from the settings on first use)."""
    if self._rule is None:
      self._rule = rule_of(self.runtime.settings)
    return self._rule

  def position(self) -> dict | None:
    """Where this process is in its steps (part of its where-report), or None before its first step."""
    with self._cond:
      if self._last is None:
        return None
      since = self._ended if self._n is None else self._began
      return {'step': self._last, 'state': self._state,
              'for': self._clock() - since, 'arrivals': self._arrivals}

  def stop(self) -> None:
    """Stops the thread (tests; a process's thread ends with it)."""
    with self._cond:
      self._stopping = True
      self._cond.notify_all()
    if self._thread is not None:
      self._thread.join(2.0)

  def _begin(self, n: int) -> None:
    rule = self.rule()  # Outside the lock: may raise on a bad variable.
    with self._cond:
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
      if limit is not None and self._thread is None and not self._stopping:
        self._start_thread()

  def _end(self, *, completed: bool) -> None:
    with self._cond:
      if self._n is None:
        return
      now = self._clock()
      if completed:
        self.learner.observe(now - self._began, self.rule())
      self._n, self._due, self._state, self._ended = None, None, 'done', now

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
            if overdue >= 0:
              stuck = (self._serial, self._n, self._began, self._due)
              break
            wait = -overdue
          else:  # A step that begins now is due no sooner than this.
            wait = self.learner.deadline(self.rule()) or 1.0
          self._cond.wait(max(wait, 0.01))
      if self._overdue(*stuck):
        return

  def _overdue(self, serial: int, n: int, began: float,
               due: float) -> bool:
    """Step `n` outlasted its deadline: reports, and leaves if it is still in progress; returns whether the thread is done."""
    rt = self.runtime
    me = rt.index
    took = self._clock() - began
    reports = _bounded(lambda: self._ask(list(range(rt.count))), ASK_BOUND_S)
    if reports is None:
      reports = {p: None for p in range(rt.count) if p != me}
    with self._cond:
      still = self._serial == serial and self._n == n
      rule = self.rule()
      why = self.learner.explain(rule)
    if not still:  # It ended while the others were asked: slow, not stuck.
      rt.log.warning(
          'multihost: step %d ran for over %.1f s, past its deadline of %.3g '
          's (%s), but ended: not leaving. Later deadlines learn from it.', n,
          took, due, why)
      return False
    line = _report(rt.prefix, me, n, took=took, due=due, why=why,
                   reports=reports, describe=self._describe)
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


def _report(prefix: str, me: int, n: int, *, took: float, due: float,
            why: str, reports: dict[int, dict | None],
            describe: Callable[[dict[int, dict | None]], str]) -> str:
  """The one line of a stuck step: the step, how long, the deadline, who is behind and where."""
  places = {p: place(r.get('step')) for p, r in reports.items()
            if r is not None}
  known = {p: k for p, k in places.items() if k is not None}
  # A process that never got as far as marking an arrival is behind those
  # that did: the program marks them if any process does.
  arrivals = any(reports[p]['step']['arrivals'] for p in known)
  lead = max(known.values(), default=None)
  behind = sorted(p for p, k in known.items() if k < lead)
  silent = sorted(p for p, r in reports.items() if r is None)
  parts = [f'{prefix} multihost: step {n} has run for {took:.1f} s on this '
           f'process, past its deadline of {due:.3g} s ({why}).']
  if behind:
    who = '; '.join(
        f'process {p}{" (this process)" if p == me else ""} is '
        f'{position_text(reports[p]["step"], arrivals=arrivals)}'
        for p in behind)
    ahead = sorted(p for p, k in known.items() if k == lead)
    parts.append(f'Behind the others: {who} (process(es) {ahead}: '
                 f'{position_text(reports[ahead[0]]["step"], arrivals=arrivals)}'
                 ').')
    shown = behind
  elif len(known) < 2:
    parts.append('Who is behind is unknown: no other process answered (one '
                 'that left first, having found this step stuck, does not).')
    shown = []
  else:
    parts.append(f'No process that answered is behind: they are all at the '
                 f'same point of step {n} (a step slow everywhere, or stuck '
                 'in a device collective).')
    shown = [p for p in known if p != me]
  shown = sorted(set(shown) | set(silent))
  if shown:
    parts.append(describe({p: reports[p] for p in shown}))
  parts.append(
      f'Leaving with exit status {peer_loss_exit.EXIT_STATUS} so that the '
      'job restarts (python -m multihost.launch --max_restarts=N does, as '
      'does a scheduler\'s requeue). A step that is slow rather than stuck '
      'needs a larger deadline: multihost.set_step_deadline(fixed=SECONDS) '
      f'or ${_env.STEP_DEADLINE}=SECONDS (0: off).')
  return ' '.join(parts)


# --- Public -----------------------------------------------------------------


def step_watch() -> StepWatch:
  """This process's step watch: `with multihost.step_watch().step(n):` around each training step ends a stuck step.

  When a step outlasts its deadline (learned by default: the first 3 steps
  are never judged, then max(60 s, 5 x the longest step since); see
  `set_step_deadline`), a thread logs one line naming the step, how long
  it ran, the deadline, the processes behind and where each is, and the
  process leaves with exit status 75 (the peer-loss exit status) so that a
  launcher or a scheduler restarts the job. Only processes with peers
  (under `jax.distributed`) are judged. `recovery`'s loop uses it around
  each step by itself. Get it after `multihost.initialize()`.
  """
  return _runtime.current().step_watch


def set_step_deadline(*, enabled: bool = True, fixed: float | None = None,
                      warmup_steps: int = DEFAULT_WARMUP_STEPS,
                      multiple: float = DEFAULT_MULTIPLE,
                      floor: float = DEFAULT_FLOOR_S) -> None:
  """Sets how long a training step may take before this process leaves (see `step_watch`).

  Overrides $MULTIHOST_STEP_DEADLINE (unset: learned with the defaults;
  'off' or 0: off; SECONDS: fixed). What the watch learned so far stays;
  the new rule applies from the next step. Set the same on every process.

  Args:
    enabled: False: no step is judged (the opt-out).
    fixed: a fixed deadline in seconds for every judged step; None: learned.
    warmup_steps: the first steps, never judged (compilation).
    multiple: a learned deadline is this many times the longest step seen
      after the warm-up (the first judged step: the shortest warm-up step).
    floor: a learned deadline is never shorter than this many seconds.

  Raises:
    ValueError: a value out of range (the message says which, and what to
      pass).
  """
  rule = Rule(enabled=bool(enabled), fixed=None if fixed is None
              else float(fixed), warmup_steps=warmup_steps,
              multiple=float(multiple), floor=float(floor))
  rt = _runtime.current()
  rt.settings.step_deadline = rule
  rt.step_watch.configure(rule)
