"""How `Checkpoints.start` begins a run: resume modes, restarts, the tier and step, damaged steps.

`MULTIHOST_RESTART_COUNT` is set by `multihost.launch` on a restart and
`SLURM_RESTART_COUNT` by Slurm on a requeue. They are read here by name,
with `os.environ`: `multihost.env` is the launcher's side of that contract.
"""

from __future__ import annotations

import os
import time
from typing import Any

from absl import logging

from multihost import env as _env
from multihost import process_prefix as _prefix
from multihost import record_event as _record_event
from recovery._src.checkpoint import damage as _damage
from recovery._src.state.errors import START_FRESH
from recovery._src.state.errors import CheckpointDamagedError
from recovery._src.state.errors import CheckpointError
from recovery._src.state.errors import FolderNotFreshError
from recovery._src.state.errors import NothingToResumeError
from recovery._src.state.state import TransitionState

IF_PRESENT = 'if_present'
RESTART_COUNT_VARIABLES = (_env.RESTART_COUNT, _env.SLURM_RESTART_COUNT)


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


def falls_back(resume: bool | str | None,
               restarted: tuple[str, int] | None) -> bool:
  """Whether `start(resume=...)` sets a damaged newest step aside and resumes from an older one.

  Yes in mode 'if_present' (the default on a restart) and on any restart or
  requeue: no one is there to decide. A strict resume=True started by hand
  refuses instead, with the error saying how to fall back.
  """
  return restarted is not None or mode(resume, restarted)[0] == IF_PRESENT


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
           directory: str, steps: list[int], partial_steps: list[int],
           local_steps: tuple[int, ...] = (),
           local_directory: str | None = None,
           local_held: tuple[dict[int, list[str]], list[int]] | None = None
           ) -> int | None:
  """The step to restore for `start(resume=...)`, or None to start fresh.

  `steps` are every tier's; the log names the local folder when the newest
  is a local step (in `local_steps`), which is then tried first.
  `local_held`: for a strict fresh start, the local steps of this folder
  on the hosts (`LocalTier.of_folder`).

  Raises:
    NothingToResumeError: a strict resume with no committed step.
    FolderNotFreshError: a strict fresh start on a folder with steps of
      either tier.
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
    if local_held and local_held[0]:
      raise FolderNotFreshError(_local_not_fresh(
          directory, local_directory, *local_held))
    return None
  if latest is None:
    if chosen is True:
      raise NothingToResumeError(nothing_to_resume(directory, partial_steps))
    logging.info('%s No committed checkpoint in %s (%s, resume if present): '
                 'starting fresh.', _prefix(), directory, why)
    return None
  if latest in local_steps:
    logging.info('%s Resuming from local step %d in %s (%s), the persistent '
                 'tier in %s as the fallback.', _prefix(), latest,
                 local_directory, why, directory)
  else:
    logging.info('%s Resuming from checkpoint step %d in %s (%s).', _prefix(),
                 latest, directory, why)
  return latest


def _local_not_fresh(directory: str, local_directory: str | None,
                     held: dict[int, list[str]], own: list[int]) -> str:
  """The refusal of a strict fresh start where the hosts hold local steps of `directory`."""
  folders = [f for fs in held.values() for f in fs]
  shown = ', '.join(folders[:6]) + (
      f' and {len(folders) - 6} more' if len(folders) > 6 else '')
  go_on = (f'Start with resume=True (or {IF_PRESENT!r}) to continue from '
           f'local step {own[-1]}; to' if own else
           'They are of an earlier run of the folder, which no resume '
           'restores; to')
  return (
      f'{_prefix()} {directory} holds no persistent checkpoint, but the local '
      f'folders ({local_directory}) hold local steps {sorted(held)} of '
      f'{directory}, left by an earlier run: {shown}. A run never silently '
      'mixes with an older one, and no step is deleted unless asked. '
      f'{go_on} start fresh on purpose, delete those step folders on every '
      'host that holds them, or use a new checkpoint folder.')


def begin(ckpt: Any, initial: TransitionState, *,
          resume: bool | str | None) -> TransitionState:
  """`Checkpoints.start` (see there): the tier and step, the restore, the fallbacks.

  Collective. Sets `ckpt.resumed_from` and `ckpt.resumed_tier`.

  Local steps at least as new as the newest persistent step are tried first
  (newest first), then that persistent step. When it is damaged
  (`damage.Damage`, agreed by every process) and the mode `falls_back`, it
  is passed over and the same is done with the next older persistent step
  as the newest (so local steps between the two are tried too), until one
  restores; then the damaged steps passed over, of both tiers, are set
  aside (renamed, never deleted: `_set_aside`). When none restores, nothing
  is set aside, and the oldest one's error is raised; a strict mode that
  does not fall back raises at the first damaged step, local or persistent.
  A step that does not fit `initial` raises `CheckpointMismatchError`
  (never damage). A strict fresh start refuses local steps of the folder
  as it does persistent ones (`decide`).
  """
  persistent = sorted(ckpt._opened.ours + ckpt._opened.linked)  # pylint: disable=protected-access
  restarted = ckpt._restarted  # pylint: disable=protected-access
  tier = ckpt.local
  candidates = []  # local steps, newest first
  held = None  # for a strict fresh start: the local steps of the folder
  if tier is not None:
    if mode(resume, restarted)[0] is not False:
      _, candidates = tier.newest()  # collective
    else:
      held = tier.of_folder()  # collective
  step = decide(
      resume, restarted=restarted, directory=ckpt.directory,
      steps=sorted({*persistent, *candidates}),
      partial_steps=ckpt.partial_steps, local_steps=tuple(candidates),
      local_directory=tier.local if tier is not None else None,
      local_held=held)
  if step is None:
    if tier is not None:
      tier.forget()
    return initial
  fallback = falls_back(resume, restarted) and not ckpt.read_only
  damaged: list[_damage.Damage] = []
  tried: set[int] = set()  # local steps
  while True:
    newest_persistent = persistent[-1] if persistent else None
    local = [s for s in candidates if s not in tried
             and (newest_persistent is None or s >= newest_persistent)]
    if local:
      tried.update(local)
      state = _restore_local(ckpt, initial, local, newest_persistent,
                             fallback)
      if state is not None:
        _set_aside(ckpt, damaged, instead=state.step, resumed_tier='local')
        return state
      if tier.damaged and not fallback:
        raise _local_damaged(tier, tier.damaged[0])
      if newest_persistent is not None:
        logging.warning('%s No local step at or after persistent step %d '
                        'restored from %s; falling back to the persistent '
                        'tier: step %d in %s.', _prefix(), newest_persistent,
                        tier.local, newest_persistent, ckpt.directory)
    if newest_persistent is None:
      if damaged:
        raise _none_verifies(ckpt.directory, damaged)
      raise CheckpointError(
          f'{_prefix()} No local step could be restored from {tier.local} '
          f'(see the errors above) and {ckpt.directory} holds no committed '
          'checkpoint. Start fresh in a new folder, or fix the local '
          'folders.')
    got = _damage.read(ckpt, initial, newest_persistent)
    if isinstance(got, _damage.Damage):
      if not fallback:
        raise got.error
      damaged.append(got)
      persistent.pop()
      continue
    _set_aside(ckpt, damaged, instead=newest_persistent,
               resumed_tier='persistent')
    ckpt.resumed_from, ckpt.resumed_tier = newest_persistent, 'persistent'
    if tier is not None:
      tier.last_saved = newest_persistent
    return got


def _restore_local(ckpt: Any, initial: TransitionState, candidates: list[int],
                   not_before: int | None,
                   fallback: bool) -> TransitionState | None:
  """The newest of the local `candidates` (>= `not_before`) that restores, or None on every process (the damaged ones in `tier.damaged`)."""
  tier, t0 = ckpt.local, time.monotonic()
  got = tier.restore(initial, candidates=candidates, not_before=not_before,
                     fall_back=fallback)
  if got is None:
    return None
  state = got.state
  ckpt.resumed_from, ckpt.resumed_tier = state.step, 'local'
  _record_event('checkpoint restore', t0, step=state.step, tier='local',
                bytes=got.fetched)
  logging.info(
      '%s Restored local step %d (epoch %d, cursor %d) from the local '
      'tier in %s in %.2f s; %d bytes came from peers to this process, '
      '%d to all; newer local steps that failed their checks: %s; the '
      'newest persistent step is %s.', _prefix(), state.step,
      state.epoch, state.cursor, tier.local, time.monotonic() - t0,
      got.fetched, got.fetched_total, list(got.failed) or 'none',
      not_before)
  return state


def _set_aside(ckpt: Any, damaged: list[_damage.Damage], *, instead: int,
               resumed_tier: str) -> None:
  """Sets aside the damaged steps the run went past, now that `resumed_tier`'s step `instead` restored: the local tier's first (tried first), then the persistent ones (`damage.set_aside`).

  Collective: every process must call this, in the same order.
  """
  tier, t0 = ckpt.local, time.monotonic()
  for d in tier.damaged if tier is not None else ():
    moved = tier.set_aside_step(d.step)
    logging.warning(
        '%s Local step %d failed its checks; %s; resuming from %s step %d '
        'instead (%s).', _prefix(), d.step,
        f"set this process's folder of it aside as {moved} (kept, never "
        'read or deleted)' if moved else 'this process holds no folder of it',
        resumed_tier, instead, d.why)
    if moved is not None:
      # Noted as a persistent one is (bin/train.py's --metrics_out records
      # both).
      _damage.record(ckpt, _damage.SetAside(d.step, 'local', moved), t0,
                     why='failed its checks', resumed_from=instead)
  if tier is not None:
    tier.damaged.clear()
  _damage.set_aside(ckpt, damaged, instead=instead, resumed_tier=resumed_tier)


def _local_damaged(tier: Any, d: Any) -> CheckpointDamagedError:
  """A strict resume's refusal of a damaged newest local step: nothing is set aside; it says how to fall back."""
  return CheckpointDamagedError(
      f'{_prefix()} Local step {d.step} in {tier.local} is damaged: {d.why}. '
      f"Start with resume={IF_PRESENT!r} (the default on a restart) to set "
      'it aside (renamed <step>-<run>.damaged-<UTC time> beside it, kept) '
      'and resume from the next older step that verifies, or '
      f'{START_FRESH}.', why=d.why)


def _none_verifies(directory: str,
                   damaged: list[_damage.Damage]) -> CheckpointDamagedError:
  """The error when every committed persistent step (and no local one) failed: nothing is set aside."""
  oldest = damaged[-1]
  message = str(oldest.error)
  if len(damaged) > 1:
    newer = '; '.join(f'step {d.step}: {d.why}' for d in damaged[:-1])
    message += (f' The newer steps are damaged too ({newer}): no checkpoint '
                f'in {directory} verifies, so none was set aside.')
  return CheckpointDamagedError(message, why=oldest.why)
