"""Liveness: the step deadline's rule (learned, fixed or off) and the deadline that the step times seen give under it.

Pure: no thread, no clock. The first `warmup_steps` steps (compilation)
are never judged; then a step's deadline is max(floor, multiple x the
longest step since warm-up), so it grows with slower steps and never
shrinks (the first judged step uses the shortest warm-up step). A fixed
deadline, or none, can be set instead (`set_step_deadline`, or
$MULTIHOST_STEP_DEADLINE: `rule_of`). `liveness.step_deadline` judges the
steps under it.
"""

from __future__ import annotations

import dataclasses

from multihost._src.runtime import settings as _settings

DEFAULT_WARMUP_STEPS = 3
DEFAULT_MULTIPLE = 5.0
DEFAULT_FLOOR_S = 60.0


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
    learned = rule.multiple * (basis or 0.0)
    # max(floor, learned), without the call (every step asks).
    return learned if learned > rule.floor else rule.floor

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
