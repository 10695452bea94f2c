"""Liveness: the step deadline's public functions, `step_watch()` and `set_step_deadline()` (`liveness.step_deadline` holds the watch)."""

from __future__ import annotations

from multihost._src.liveness import step_deadline
from multihost._src.liveness import step_rule
from multihost._src.runtime import runtime as _runtime


def step_watch() -> step_deadline.StepWatch:
  """This process's step watch: `with multihost.step_watch().step(n):` around each training step ends a stuck step.

  When a step outlasts its deadline (learned by default: the first 3 steps
  are never judged, then max(60 s, 5 x the longest step since); see
  `set_step_deadline`), a thread logs one line naming the step, how long
  it ran, the deadline, the processes behind and where each is, and the
  process leaves with exit status 75 (the peer-loss exit status) so that a
  launcher or a scheduler restarts the job. Only processes with peers
  (under `jax.distributed`) are judged. A loop that leaves no code
  unwatched marks each step's end with `between()` (the step stays judged
  until the next `begin`) and calls `end()` once where it ends;
  `recovery`'s loop does so by itself. Get it after
  `multihost.initialize()`.
  """
  return _runtime.current().step_watch


def set_step_deadline(*, enabled: bool = True, fixed: float | None = None,
                      warmup_steps: int = step_rule.DEFAULT_WARMUP_STEPS,
                      multiple: float = step_rule.DEFAULT_MULTIPLE,
                      floor: float = step_rule.DEFAULT_FLOOR_S) -> None:
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
  rule = step_rule.Rule(enabled=bool(enabled), fixed=None if fixed is None
                        else float(fixed), warmup_steps=warmup_steps,
                        multiple=float(multiple), floor=float(floor))
  rt = _runtime.current()
  rt.settings.step_deadline = rule
  rt.step_watch.configure(rule)
