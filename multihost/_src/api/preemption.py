"""Public collective: preemption sync points (JAX's preemption sync manager)."""

from __future__ import annotations

from jax.experimental import multihost_utils as _jax_multihost_utils


def reached_preemption_sync_point(step_id: int) -> bool:
  """Returns True on every process at the same step after a preemption notice.

  Collective: every process must call this at every step, in the same order,
  starting from the same step.

  When any process receives SIGTERM (the preemption notice), JAX's
  preemption sync manager agrees on a step (the largest step any process
  has reported, plus one) and this returns True on every process at that
  step, so they can all save a checkpoint and exit together. A watcher
  notices the signal about once a second, so the agreed step falls a few
  steps after the signal.

  Without `jax.distributed` it always returns False (and SIGTERM keeps its
  default action of killing the process).

  Args:
    step_id: the current training step.

  Returns:
    True when every process has reached the agreed preemption step.
  """
  if isinstance(step_id, bool) or not isinstance(step_id, int):
    try:
      step_id = int(step_id)
    except (TypeError, ValueError):
      raise TypeError(f'step_id must be an int; got {step_id!r}.') from None
  return _jax_multihost_utils.reached_preemption_sync_point(step_id)
