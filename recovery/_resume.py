"""How `Checkpoints.start` begins a run: the resume modes, restarts read from the environment, the decision.

`MULTIHOST_RESTART_COUNT` is set by `multihost.launch` on a restart and
`SLURM_RESTART_COUNT` by Slurm on a requeue. They are read here by name,
with `os.environ`: `multihost.env` is the launcher's side of that contract.
"""

from __future__ import annotations

import os

from absl import logging

from multihost.lowlevel import process_prefix as _prefix
from recovery._errors import FolderNotFreshError
from recovery._errors import NothingToResumeError

IF_PRESENT = 'if_present'
RESTART_COUNT_VARIABLES = ('MULTIHOST_RESTART_COUNT', 'SLURM_RESTART_COUNT')


def restart() -> tuple[str, int] | None:
  """(variable, count) of the first restart counter above 0, if any."""
  for name in RESTART_COUNT_VARIABLES:
    raw = os.environ.get(name, '').strip()
    if not raw:
      continue
    try:
      count = int(raw)
    except ValueError:
      logging.warning('%s Ignoring %s=%r: not an integer.', _prefix(), name,
                      raw)
      continue
    if count > 0:
      return name, count
  return None


def mode(resume: bool | str | None,
         restarted: tuple[str, int] | None) -> tuple[bool | str, str]:
  """(True | False | IF_PRESENT, why) for `start(resume=...)` after `restarted`.

  None (the default) is a strict fresh start, except on a restart or
  requeue, which resumes if a checkpoint is present.

  Raises:
    ValueError: `resume` is none of True, False, 'if_present', None.
  """
  if resume is None:
    if restarted is not None:
      return IF_PRESENT, f'{restarted[0]}={restarted[1]}: a restart'
    return False, 'no restart'
  if resume is True or resume is False or resume == IF_PRESENT:
    return resume, f'resume={resume!r}'
  raise ValueError(
      f"resume must be True, False, {IF_PRESENT!r} or None (the default: "
      f"{IF_PRESENT!r} on a restart, else False); got {resume!r}.")


def nothing_to_resume(directory: str, partial_steps: list[int]) -> str:
  msg = (f'{_prefix()} No committed checkpoint in {directory}, so there is '
         'nothing to resume from.')
  if partial_steps:
    msg += (f' Only partial saves (steps {partial_steps}) were found: a save '
            'was interrupted before it committed.')
  return msg + (' Start with resume=False to begin a fresh run, or with '
                f'resume={IF_PRESENT!r} to resume only when a checkpoint '
                'exists.')


def decide(resume: bool | str | None, *, restarted: tuple[str, int] | None,
           directory: str, steps: list[int],
           partial_steps: list[int]) -> int | None:
  """The step to restore for `start(resume=...)`, or None to start fresh.

  Raises:
    NothingToResumeError: a strict resume with no committed step.
    FolderNotFreshError: a strict fresh start on a folder with steps.
    ValueError: an unknown mode.
  """
  chosen, why = mode(resume, restarted)
  latest = steps[-1] if steps else None
  if chosen is False:
    if latest is not None:
      raise FolderNotFreshError(
          f'{_prefix()} {directory} already holds checkpoint steps {steps}. '
          f'Start with resume=True (or {IF_PRESENT!r}) to continue from step '
          f'{latest}, or use a new folder for a fresh run.')
    return None
  if latest is None:
    if chosen is True:
      raise NothingToResumeError(nothing_to_resume(directory, partial_steps))
    logging.info('%s No committed checkpoint in %s (%s, resume if present): '
                 'starting fresh.', _prefix(), directory, why)
    return None
  logging.info('%s Resuming from checkpoint step %d in %s (%s).', _prefix(),
               latest, directory, why)
  return latest
