"""Checkpoints of transition states in one folder: open, save, keep-N, restore, start."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from absl import logging
import jax

from multihost import process_prefix as _prefix
from multihost import record_event as _record_event
from recovery._src.checkpoint import carrier
from recovery._src.checkpoint import damage
from recovery._src.checkpoint import folder
from recovery._src.checkpoint import lock
from recovery._src.checkpoint import manager
from recovery._src.checkpoint import resume as _resume
from recovery._src.local import tier
from recovery._src.state import consistency
from recovery._src.state import leaves
from recovery._src.state import meta as _meta
from recovery._src.state.errors import CheckpointDamagedError
from recovery._src.state.errors import CheckpointError
from recovery._src.state.errors import CheckpointFolderError
from recovery._src.state.errors import NothingToResumeError
from recovery._src.state.errors import fallback_advice
from recovery._src.state.errors import shorten as _short
from recovery._src.state.state import TransitionState

PyTree = Any

READABLE_FORMATS = _meta.READABLE_FORMATS


class Checkpoints:
  """Saves and restores `TransitionState`s with Orbax's `CheckpointManager`.

  Each checkpoint step holds two items: `state` (the whole transition state:
  user state, PRNG key data, data order, cursor, epoch, step) and `meta` (a
  JSON item with the step, the leaf shapes and a digest of the state's global
  content). Saves are atomic (Orbax writes `<step>.orbax-checkpoint-tmp` and
  renames it on commit), optionally asynchronous. Keep-N keeps the newest
  `keep` of this project's steps that are real folders in this folder, the
  steps of earlier runs on it included (a resumed run prunes the steps it
  resumed from); it never deletes a symlinked or foreign entry. Restores go
  onto the shardings of a target state built on the current mesh, never onto
  shardings read from the checkpoint, so a run can resume on a different
  number of processes or devices.

  With `local_directory`, a second, local tier (`recovery._src.local.tier`): every
  `local_save_every` steps each process writes only the blocks it holds to
  its own host's folder at that path (the same path on every host, each on
  its own disk), and blocks held by one host only are copied to a peer
  host. `start` restores the newer of the newest local step complete across
  all hosts and the newest persistent step, the local one on a tie; when
  a local step cannot be restored (another topology, missing blocks, a
  failed digest check) it tries the older ones down to the newest
  persistent step, then falls back to the persistent tier. A local save
  that fails is logged and recorded, never raised.

  With `read_once` (the default) a persistent restore reads each leaf every
  process holds whole on one process, which sends it on (`read_once`).
  Every method that saves or restores is a collective: every process must
  call it, in the same order, on a folder that all processes share.

  Attributes:
    directory: the folder's absolute path.
    partial_steps: steps of saves that never committed, found when opened.
    resumed_from: the step `start` restored, or None (fresh, or not started).
    resumed_tier: 'local' or 'persistent' after a restoring `start`, else None.
    set_aside: every damaged folder `start` renamed aside, in that order: a
      `SetAside` (step, tier, new path) each; a step damaged in both tiers
      is there twice (for a local step, this process's folder of it).
    local: the local tier, or None.
    read_from_storage: bytes this process read while Orbax read the last
      restored persistent step (/proc/self/io rchar), or None.
  """

  def __init__(self, directory: str | os.PathLike, *, save_every: int = 100,
               keep: int = 3, async_save: bool = True,
               read_only: bool = False, read_once: bool = True,
               local_directory: str | os.PathLike | None = None,
               local_save_every: int | None = None, local_keep: int = 2):
    if save_every < 1 or keep < 1:
      raise ValueError(
          f'save_every and keep must be >= 1; got save_every={save_every}, '
          f'keep={keep}.')
    if local_directory is None and local_save_every is not None:
      raise ValueError(
          f'local_save_every={local_save_every} needs local_directory (the '
          'host-local folder of the local tier).')
    if local_directory is not None and read_only:
      raise ValueError('A read-only Checkpoints has no local tier; pass '
                       'local_directory=None with read_only=True.')
    self.directory = os.path.abspath(os.fspath(directory))
    self.save_every = int(save_every)
    self.keep = int(keep)
    self.read_only, self.read_once = read_only, bool(read_once)
    self.resumed_from: int | None = None
    self.resumed_tier: str | None = None
    self.set_aside: list[damage.SetAside] = []
    self.local: tier.LocalTier | None = None
    self._lock = None
    self._pending: int | None = None  # a started save, not yet waited for
    self._reader = self.read_from_storage = None  # (read_once's)

    def listed():
      return (folder.scan(self.directory, READABLE_FORMATS),
              _resume.restart())

    if read_only:
      if not os.path.isdir(self.directory):
        raise CheckpointFolderError(
            f'{_prefix()} Checkpoint folder {self.directory} does not exist.')
      opened = listed()
    else:
      folder.ensure_writable(self.directory)
      self._lock, opened = lock.FolderLock.acquire(self.directory,
                                                    listing=listed)
    # Process 0's listing under the lock and its restart counter, the same
    # on every process: `start` decides from them, and keep-N deletes from
    # `_committed` (then changed only by collective saves and deletes), so
    # every process takes the same (collective) decisions without a
    # broadcast.
    self._opened: folder.Listing = opened[0]
    self._restarted: tuple[str, int] | None = opened[1]
    self._committed: list[int] = list(self._opened.ours)
    self.partial_steps = folder.partial_steps(self.directory)
    if self.partial_steps:
      logging.warning(
          '%s %s holds uncommitted (partial) saves of steps %s, left by a '
          'save that was interrupted; they are ignored (a new save of the '
          'same step replaces one).',
          _prefix(), self.directory, self.partial_steps)
    folder.prepare(self.directory, self._opened, writable=not read_only)
    try:
      self._manager = manager.manager(self.directory, async_save=async_save,
                                     read_only=read_only)
      if local_directory is not None:
        self.local = tier.LocalTier(
            local_directory, directory=self.directory,
            every=(save_every if local_save_every is None
                   else local_save_every), keep=local_keep)
    except BaseException:
      if self._lock is not None:
        self._lock.release()
      raise

  # -- queries ---------------------------------------------------------------

  def steps(self) -> list[int]:
    """Committed checkpoint steps that can be restored, oldest first.

    Symlinked steps are included (they can be read), foreign entries not.
    """
    return [s for s in sorted(self._manager.all_steps())
            if folder.is_ours(self.directory, s, READABLE_FORMATS)]

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def read_meta(self, step: int) -> dict[str, Any]:
    """The JSON metadata item of committed checkpoint `step`."""
    where = f'Checkpoint step {step} in {self.directory}'
    try:
      meta = dict(folder.read_meta(self.directory, step))
    except Exception as e:  # pylint: disable=broad-except
      finding = (f'its `{manager.META_ITEM}` item cannot be read '
                 f'({type(e).__name__}: {_short(e)})')
      raise CheckpointDamagedError(
          f'{_prefix()} {where} is corrupt or partial: {finding}. '
          f'{self._fallback_hint(step)}', why=finding) from e
    _meta.check_format(meta, where=where, hint=self._fallback_hint(step))
    return meta

  def stored_tree(self, step: int) -> PyTree:
    """The stored state's tree of `np.zeros` with the stored shapes and dtypes.

    A restore target for tools that have no model at hand (such as
    a checkpoint checker); it restores every leaf as a NumPy array. The
    dtypes are the saved leaves' own (from the meta item), also for a leaf
    Orbax stores in a carrier dtype (`carrier`: uint4 in uint8).
    """
    return damage.stored_tree(self, step)

  def _fallback_hint(self, step: int) -> str:
    return fallback_advice(self.directory, step, self.steps())

  # -- save ------------------------------------------------------------------

  def save(self, state: TransitionState, *, force: bool = False,
           reason: str = '') -> bool:
    """Saves `state` at `state.step` if that step is due (or `force`).

    Collective: every process must call this, in the same order.

    Before saving, checks that every controller holds an identical state
    (`check_consistent`). The save is committed atomically; with async
    saving it completes in the background (`wait()` blocks until it has). A
    step whose folder already exists (symlinked, foreign, or not written by
    this run) is never written: the save is skipped with a warning.

    Returns:
      Whether a save was started.

    Raises:
      multihost.ConsistencyError: the controllers hold different states.
      CheckpointError: the save could not be started.
    """
    step, start = state.step, time.monotonic()
    if self.local is not None and self.local.due(step):
      self.local.save(state)
    if not force and step % self.save_every:
      return False
    if step == self._pending or step in self._committed:
      return False  # Saved already (by this run or the one it resumed).
    path = os.path.join(self.directory, str(step))
    if os.path.lexists(path):
      logging.warning('%s Not saving step %d: %s already exists and this '
                      'run did not write it.', _prefix(), step, path)
      return False
    self.wait()  # Orbax's save waits for the previous one too; then prunes
    raw = state.to_tree()
    try:
      tree = leaves.storable(raw)
      saved = carrier.encode(tree)  # What Orbax writes (the same bits).
    except TypeError as e:
      raise CheckpointError(
          f'{_prefix()} Cannot save step {step}: {e}') from None
    digests = consistency.check_consistent(
        tree, what=f'Before saving step {step}')
    meta = _meta.build(state, raw, tree, digests, reason=reason,
                       storage=carrier.storage(tree))
    manager.watched(
        f'save checkpoint step {step}',
        functools.partial(self._manager.save, step, force=True,
                          args=manager.save_args(saved, meta)),
        lambda e: (f'{_prefix()} Saving step {step} to {self.directory} '
                   f'failed: {type(e).__name__}: {_short(e)}. The previous '
                   f'checkpoint (step {self._on_disk()}) is untouched.'))
    self._pending = step
    _record_event('checkpoint save', start, step=step, reason=reason)
    # One line per event: a scheduled save is routine (absl's
    # --verbosity=1 shows it); a preemption's or the final one is said once,
    # by process 0.
    reason = reason or 'scheduled'
    if reason != 'scheduled' and jax.process_index() == 0:
      logging.info('%s Saving checkpoint step %d (%s) to %s.', _prefix(),
                   step, reason, self.directory)
    else:
      logging.debug('%s Saving checkpoint step %d (%s) to %s.', _prefix(),
                    step, reason, self.directory)
    return True

  def wait(self) -> None:
    """Blocks until an asynchronous save has committed; then applies keep-N."""
    pending, self._pending = self._pending, None
    manager.watched(
        'commit checkpoint', self._manager.wait_until_finished,
        lambda e: (f'{_prefix()} An asynchronous save to {self.directory} '
                   f'failed: {type(e).__name__}: {_short(e)}. The last '
                   f'committed checkpoint is step {self._on_disk()}.'))
    if pending is not None:
      self._committed = sorted({*self._committed, pending})
    self._prune()

  def _on_disk(self) -> int | None:
    """The latest committed step of this format, read from disk (not Orbax's cache)."""
    listing = folder.scan(self.directory, READABLE_FORMATS)
    steps = sorted(listing.ours + listing.linked)
    return steps[-1] if steps else None

  def _prune(self) -> None:
    """Keeps the newest `keep` of `_committed` (`checkpoint.manager.prune`)."""
    if not self.read_only:
      manager.prune(self._manager, self.directory, self._committed,
                   keep=self.keep)

  def close(self) -> None:
    try:
      if self.local is not None:
        self.local.close()
      self.wait()
      self._manager.close()
      if self._reader is not None:
        self._reader.close()
    finally:
      if self._lock is not None:
        self._lock.release()

  def __enter__(self) -> Checkpoints:
    return self

  def __exit__(self, *exc) -> None:
    if exc[0] is None:
      self.close()
    else:
      try:
        self.close()
      except Exception:  # pylint: disable=broad-except
        logging.exception('%s Closing %s after an error failed.', _prefix(),
                          self.directory)

  # -- restore ---------------------------------------------------------------

  def restore(self, target: TransitionState, *,
              step: int | None = None) -> TransitionState:
    """Restores checkpoint `step` (default: latest) onto `target`'s shardings.

    Collective: every process must call this, in the same order.

    `target` is a state built on the current mesh (e.g. the run's initial
    state); its leaves give the shapes, dtypes and shardings to restore onto.
    The stored shapes must match. After reading, the state's digest must equal
    the one stored at save time, and every controller must hold an identical
    state.

    Raises:
      CheckpointError: no such checkpoint.
      CheckpointDamagedError: its files cannot be read (on every process,
        when on any).
      CheckpointCorruptError: the restored state fails the digest check (a
        `CheckpointDamagedError`).
      CheckpointMismatchError: shapes that do not fit `target` (e.g. a
        different model width).
      multihost.ConsistencyError: the controllers restored different states.
    """
    if step is None:
      step = self.latest_step()
      if step is None:
        raise NothingToResumeError(_resume.nothing_to_resume(
            self.directory, self.partial_steps))
    elif step not in self.steps():
      raise CheckpointError(
          f'{_prefix()} {self.directory} has no committed checkpoint step '
          f'{step}; committed steps: {self.steps()}.')
    got = damage.read(self, target, step)
    if isinstance(got, damage.Damage):
      raise got.error
    return got

  # -- start -----------------------------------------------------------------

  def start(self, initial: TransitionState, *,
            resume: bool | str | None = None) -> TransitionState:
    """Begins a run: restores the newest committed step, or starts from `initial`.

    Collective: every process must call this, in the same order.

    The modes (the decision is process 0's, from the folder as it was when
    opened, so every process takes the same one):

      resume=True          resume; an error when there is no checkpoint.
      resume=False         start fresh; an error when the folder already
                           holds a checkpoint, so a run never silently mixes
                           with an older one.
      resume='if_present'  resume when there is a checkpoint, else start
                           fresh (for jobs that a scheduler restarts).
      resume=None          the default: 'if_present' on a restart or requeue
                           ($MULTIHOST_RESTART_COUNT or $SLURM_RESTART_COUNT
                           above 0), else False.

    Symlinked steps of this project count as checkpoints (they are read,
    never deleted); `resumed_from` tells which step was restored, and
    `resumed_tier` from which tier. With a local tier, its newest step
    complete across all hosts counts too, and is restored when it is at
    least as new as the persistent one (see the class docstring); a strict
    fresh start refuses local steps of this folder as persistent ones.

    A damaged newest persistent step (its files cannot be read, or it fails
    its digest check, on any process) is set aside in mode 'if_present' and
    on any restart: process 0 renames it to `<step>.damaged-<UTC time>` in
    the folder (kept, never read or deleted), every process logs one line
    and records a 'checkpoint set aside' event, and the next older step that
    verifies (or a local step at least as new) is restored; `set_aside`
    lists what was moved. Every process takes the same decision, from
    findings gathered from all. When no step verifies, nothing is moved and
    the oldest one's `CheckpointDamagedError` is raised. A strict
    resume=True that is no restart raises the newest one's error instead
    (a person decides; it says how to fall back). Local steps alike. A step
    that does not fit `initial` is no damage: `CheckpointMismatchError`.

    Args:
      initial: the fresh initial state, built on the current mesh; it is the
        restore target.
      resume: the mode, above.

    Raises:
      NothingToResumeError: resume=True and no committed checkpoint.
      CheckpointDamagedError: no step verifies, or a strict resume=True (no
        restart) found the newest one damaged.
      FolderNotFreshError: a strict fresh start on a folder with checkpoints
        (persistent, or local steps of the folder on the hosts).
      ValueError: an unknown mode.
      (and what `restore` raises)
    """
    return _resume.begin(self, initial, resume=resume)
