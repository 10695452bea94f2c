"""Orbax `CheckpointManager` save/restore of transition states onto the mesh."""

from __future__ import annotations

from collections.abc import Callable
import functools
import os
import re
from typing import Any

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp

import multihost
from multihost.lowlevel import process_prefix as _prefix
from multihost.lowlevel import shorten as _short
from recovery import _consistency
from recovery import _folder
from recovery import _lock
from recovery import _digest
from recovery import _leaves
from recovery._errors import CheckpointCorruptError
from recovery._errors import CheckpointError
from recovery._errors import fallback_advice
from recovery._state import TransitionState

PyTree = Any

STATE_ITEM = 'state'
META_ITEM = 'meta'
FORMAT = 'recovery-checkpoint-v2'
# Earlier formats this version restores: v1 stored the same leaves (global
# jax.Arrays and NumPy arrays, in nested dicts) and did not list their kinds.
READABLE_FORMATS = (FORMAT, 'recovery-checkpoint-v1')
_TMP_SUFFIX = '.orbax-checkpoint-tmp'


class Checkpoints:
  """Saves and restores `TransitionState`s with Orbax's `CheckpointManager`.

  Each checkpoint step holds two items: `state` (the whole transition state:
  user state, PRNG key data, data order, cursor, epoch, step) and `meta` (a
  JSON item with the step, the leaf shapes and a digest of the state's global
  content). Saves are atomic (Orbax writes `<step>.orbax-checkpoint-tmp` and
  renames it on commit), optionally asynchronous, and only the last `keep`
  are kept. Restores go onto the shardings of a target state built on the
  current mesh, never onto shardings read from the checkpoint, so a run can
  resume on a different number of processes or devices.

  Every method that saves or restores is a collective: every process must
  call it, in the same order, on a folder that all processes share.
  """

  def __init__(self, directory: str | os.PathLike, *, save_every: int = 100,
               keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    if save_every < 1 or keep < 1:
      raise ValueError(
          f'save_every and keep must be >= 1; got save_every={save_every}, '
          f'keep={keep}.')
    self.directory = os.path.abspath(os.fspath(directory))
    self.save_every = int(save_every)
    self.keep = int(keep)
    self.read_only = read_only
    self._lock = None
    # This run's committed steps of this format, oldest first: what keep-N
    # deletes from. The same list on every process (read by process 0 under
    # the lock, then changed only by collective saves and deletes), so every
    # process makes the same (collective) deletions without a broadcast.
    self._committed: list[int] = []
    self._pending: int | None = None  # a started save, not yet waited for
    if read_only:
      if not os.path.isdir(self.directory):
        raise CheckpointError(
            f'{_prefix()} Checkpoint folder {self.directory} does not exist.')
    else:
      _ensure_writable(self.directory)
      self._lock, committed = _lock.FolderLock.acquire(
          self.directory, listing=lambda: _folder.scan(
              self.directory, READABLE_FORMATS)[0])
      self._committed = list(committed)
    self.partial_steps = _partial_steps(self.directory)
    if self.partial_steps:
      logging.warning(
          '%s %s holds uncommitted (partial) saves of steps %s, left by a '
          'save that was interrupted; they are ignored (a new save of the '
          'same step replaces one).',
          _prefix(), self.directory, self.partial_steps)
    _folder.prepare(self.directory, READABLE_FORMATS, writable=not read_only)
    # Naming every process as active makes Orbax meet at the coordination
    # service's barriers (with a timeout) instead of at JAX's
    # sync_global_devices, a device all-gather per barrier: a save meets 8
    # times, and at 4 processes here that took 6-19 ms each instead of ~0.6.
    # Orbax then leaves creating the folder to us (done above).
    processes = jax.process_count()
    multiprocessing = ocp.options.MultiprocessingOptions(
        active_processes=set(range(processes)) if processes > 1 else None)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None,  # keep-N is `_prune`'s: it deletes only our steps
        # Saves are scheduled by `save()`; Orbax's own interval is unused.
        save_interval_steps=0 if read_only else 1,
        enable_async_checkpointing=async_save,
        create=not read_only and processes == 1,
        read_only=read_only,
        cleanup_tmp_directories=False,
        multiprocessing_options=multiprocessing,
    )
    try:
      self._manager = ocp.CheckpointManager(
          self.directory, options=options,
          item_handlers={
              STATE_ITEM: ocp.StandardCheckpointHandler(
                  multiprocessing_options=multiprocessing),
              META_ITEM: ocp.JsonCheckpointHandler(
                  multiprocessing_options=multiprocessing)})
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(
          f'{_prefix()} Cannot open checkpoint folder {self.directory}: '
          f'{type(e).__name__}: {e}') from e

  # -- queries ---------------------------------------------------------------

  def steps(self) -> list[int]:
    """Committed checkpoint steps, oldest first."""
    return [s for s in sorted(self._manager.all_steps())
            if _folder.is_ours(self.directory, s, READABLE_FORMATS)]

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def read_meta(self, step: int) -> dict[str, Any]:
    """The JSON metadata item of committed checkpoint `step`."""
    try:
      meta = dict(_folder.read_meta(self.directory, step))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(
          f'{_prefix()} Checkpoint step {step} in {self.directory} is corrupt '
          f'or partial: its `{META_ITEM}` item cannot be read '
          f'({type(e).__name__}: {_short(e)}). {self._fallback_hint(step)}'
      ) from e
    if meta.get('format') not in READABLE_FORMATS or 'digest' not in meta:
      raise CheckpointError(
          f'{_prefix()} Checkpoint step {step} in {self.directory} is not a '
          f'{" or ".join(READABLE_FORMATS)} checkpoint (format '
          f'{meta.get("format")!r}, metadata keys: {sorted(meta)}). '
          f'{self._fallback_hint(step)}')
    return meta

  def stored_tree(self, step: int) -> PyTree:
    """The stored state's tree of `np.zeros` with the stored shapes and dtypes.

    A restore target for tools that have no model at hand (such as
    `bin/verify_checkpoint.py`); it restores every leaf as a NumPy array.
    """
    try:
      meta = self._manager.item_metadata(step)[STATE_ITEM]
      tree = meta.tree if hasattr(meta, 'tree') else meta
      return jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), tree)
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(
          f'{_prefix()} Checkpoint step {step} in {self.directory} has '
          f'unreadable array metadata ({type(e).__name__}: {_short(e)}). '
          f'{self._fallback_hint(step)}') from e

  def _fallback_hint(self, step: int) -> str:
    return fallback_advice(self.directory, step, self.steps())

  # -- save ------------------------------------------------------------------

  def save(self, state: TransitionState, *, force: bool = False,
           reason: str = '') -> bool:
    """Saves `state` at `state.step` if that step is due (or `force`).

    Collective: every process must call this, in the same order.

    Before saving, checks that every controller holds an identical state
    (`check_consistent`). The save is committed atomically; with async
    saving it completes in the background (`wait()` blocks until it has).

    Returns:
      Whether a save was started.

    Raises:
      multihost.ConsistencyError: the controllers hold different states.
      CheckpointError: the save could not be started.
    """
    step = state.step
    if not force and step % self.save_every:
      return False
    if step in self._manager.all_steps():
      return False
    if os.path.lexists(os.path.join(self.directory, str(step))):
      logging.warning('%s Not saving step %d: %s already exists and this '
                      'run did not write it.', _prefix(), step,
                      os.path.join(self.directory, str(step)))
      return False
    self.wait()  # Orbax's save waits for the previous one too; then prunes
    raw = state.to_tree()
    try:
      tree = _leaves.storable(raw)
    except TypeError as e:
      raise CheckpointError(
          f'{_prefix()} Cannot save step {step}: {e}') from None
    digests = _consistency.check_consistent(
        tree, what=f'Before saving step {step}')
    meta = {
        'format': FORMAT,
        'step': step,
        'epoch': state.epoch,
        'cursor': state.cursor,
        'digest': _digest.combine(digests),
        'leaf_digests': digests,
        'digest_algorithm': _digest.DIGEST_ALGORITHM,
        'key_impl': str(jax.random.key_impl(state.key)),
        'leaves': _leaf_specs(tree),
        'kinds': _leaf_kinds(raw),
        'process_count': jax.process_count(),
        'device_count': jax.device_count(),
        'reason': reason,
    }
    _watched(
        f'save checkpoint step {step}',
        functools.partial(self._manager.save, step, force=True,
                          args=ocp.args.Composite(**{
                              STATE_ITEM: ocp.args.StandardSave(tree),
                              META_ITEM: ocp.args.JsonSave(meta),
                          })),
        lambda e: (f'{_prefix()} Saving step {step} to {self.directory} '
                   f'failed: {type(e).__name__}: {_short(e)}. The previous '
                   f'checkpoint (step {self._on_disk()}) is untouched.'))
    self._pending = step
    logging.info('%s Saving checkpoint step %d (%s) to %s.', _prefix(), step,
                 reason or 'scheduled', self.directory)
    return True

  def wait(self) -> None:
    """Blocks until an asynchronous save has committed."""
    pending, self._pending = self._pending, None
    _watched(
        'commit checkpoint', self._manager.wait_until_finished,
        lambda e: (f'{_prefix()} An asynchronous save to {self.directory} '
                   f'failed: {type(e).__name__}: {_short(e)}. The last '
                   f'committed checkpoint is step {self._on_disk()}.'))
    if pending is not None:
      self._committed = sorted({*self._committed, pending})
    self._prune()

  def _on_disk(self) -> int | None:
    """The latest committed step of this format, read from disk (not Orbax's cache)."""
    ours = _folder.scan(self.directory, READABLE_FORMATS)[0]
    return ours[-1] if ours else None

  def _prune(self) -> None:
    """Keeps the newest `keep` committed steps; deletes only this format's steps.

    Every process holds the same `_committed`, so all delete the same steps,
    or all skip the (collective) delete together.
    """
    if self.read_only:
      return
    for step in self._committed[:-self.keep]:
      # Orbax's delete meets the other processes: watched.
      _watched(
          f'delete checkpoint step {step}',
          functools.partial(self._manager.delete, step),
          lambda e, step=step: (
              f'{_prefix()} Deleting old checkpoint step {step} in '
              f'{self.directory} failed: {type(e).__name__}: {_short(e)}. '
              'Newer steps are untouched; remove it by hand if it remains.'))
      self._committed.remove(step)

  def close(self) -> None:
    try:
      self.wait()
      self._manager.close()
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
      CheckpointError: no checkpoint, unreadable files, or shapes that do not
        fit `target` (e.g. a different model width).
      CheckpointCorruptError: the restored state fails the digest check.
      multihost.ConsistencyError: the controllers restored different states.
    """
    if step is None:
      step = self.latest_step()
      if step is None:
        raise CheckpointError(self._no_checkpoint_message())
    elif step not in self.steps():
      raise CheckpointError(
          f'{_prefix()} {self.directory} has no committed checkpoint step '
          f'{step}; committed steps: {self.steps()}.')
    meta = self.read_meta(step)
    target_tree = target.to_tree()
    try:
      abstract = _leaves.restore_target(target_tree, meta.get('leaves'))
    except TypeError as e:
      raise CheckpointError(
          f'{_prefix()} Cannot restore step {step} onto this target: {e}'
      ) from None
    self._check_fits(step, meta, abstract)
    restored = _watched(
        f'restore checkpoint step {step}',
        functools.partial(self._manager.restore, step,
                          args=ocp.args.Composite(**{
                              STATE_ITEM: ocp.args.StandardRestore(
                                  abstract)})),
        lambda e: (f'{_prefix()} Checkpoint step {step} in {self.directory} '
                   f'cannot be read: {type(e).__name__}: {_short(e)}. The '
                   f'files are damaged or incomplete. '
                   f'{self._fallback_hint(step)}'))[STATE_ITEM]
    if meta.get('digest_algorithm') != _digest.DIGEST_ALGORITHM:
      raise CheckpointError(
          f'{_prefix()} Checkpoint step {step} was digested with '
          f'{meta.get("digest_algorithm")!r}; this version checks '
          f'{_digest.DIGEST_ALGORITHM!r}. Restore it with the version that '
          'wrote it.')
    digests = _digest.checkpoint_leaf_digests(restored)
    got = _digest.combine(digests)
    if got != meta['digest']:
      stored = meta.get('leaf_digests', {})
      changed = sorted(k for k in digests if stored.get(k) != digests[k])
      raise CheckpointCorruptError(
          f'{_prefix()} Checkpoint step {step} in {self.directory} fails its '
          f'digest check: stored {meta["digest"][:16]}..., restored state '
          f'digests to {got[:16]}... (leaves that changed: '
          f'{", ".join(changed) or "unknown"}). Its files were altered or '
          f'damaged after the save committed; refusing to resume from it. '
          f'{self._fallback_hint(step)}')
    _consistency.check_consistent(
        restored, what=f'After restoring step {step}', digests=digests)
    state = TransitionState.from_tree(
        _leaves.rebuild(target_tree, restored), key_like=target.key)
    if state.step != step:
      raise CheckpointCorruptError(
          f'{_prefix()} Checkpoint folder {step} holds a state at step '
          f'{state.step}. {self._fallback_hint(step)}')
    logging.info('%s Restored checkpoint step %d (epoch %d, cursor %d, '
                 'digest %s...) from %s onto %d processes, %d devices.',
                 _prefix(), step, state.epoch, state.cursor, got[:12],
                 self.directory, jax.process_count(), jax.device_count())
    return state

  def _check_fits(self, step: int, meta: dict[str, Any], target_tree) -> None:
    want = _leaf_specs(target_tree)
    have = meta.get('leaves', {})
    problems = []
    for name in sorted(set(want) | set(have)):
      if name not in have:
        problems.append(f'{name}: missing from the checkpoint, this run '
                        f'expects {want[name]}')
      elif name not in want:
        problems.append(f'{name}: in the checkpoint ({have[name]}) but not '
                        'in this run\'s state')
      elif list(have[name]) != list(want[name]):
        problems.append(f'{name}: checkpoint has {have[name]}, this run '
                        f'expects {want[name]}')
    if problems:
      raise CheckpointError(
          f'{_prefix()} Checkpoint step {step} in {self.directory} does not '
          f'fit this run: ' + '; '.join(problems) + '. It was made with a '
          'different model or data configuration (e.g. another --width or '
          '--samples): resume with the flags that made it, or start fresh in a '
          'new folder.')

  def _no_checkpoint_message(self) -> str:
    msg = (f'{_prefix()} No committed checkpoint in {self.directory}, so '
           'there is nothing to resume from.')
    if self.partial_steps:
      msg += (f' Only partial saves (steps {self.partial_steps}) were found: '
              'a save was interrupted before it committed.')
    return msg + ' Start without --resume (resume=False) to begin a fresh run.'

  # -- start -----------------------------------------------------------------

  def start(self, initial: TransitionState, *, resume: bool) -> TransitionState:
    """Strict start: restores the latest step, or checks the folder is new.

    Collective: every process must call this, in the same order.

    Args:
      initial: the fresh initial state, built on the current mesh; it is the
        restore target.
      resume: True to continue from the latest committed checkpoint (an error
        when there is none); False to start fresh (an error when the folder
        already holds a checkpoint, so a run never silently mixes with an
        older one).
    """
    latest = self.latest_step()
    if resume:
      if latest is None:
        raise CheckpointError(self._no_checkpoint_message())
      return self.restore(initial)
    if latest is not None:
      raise CheckpointError(
          f'{_prefix()} {self.directory} already holds checkpoint steps '
          f'{self.steps()}. Pass --resume (resume=True) to continue from step '
          f'{latest}, or use a new folder for a fresh run.')
    return initial


def _leaf_specs(stored) -> dict[str, list]:
  """{path: [shape, dtype]} of a storable (or abstract storable) tree."""
  return {_digest.path_name(path): _leaves.spec(leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(stored)[0]}


def _leaf_kinds(tree) -> dict[str, str]:
  """{path: how the saving run held the leaf}, for people reading metadata."""
  flat, _ = _leaves.leaves(tree)
  return {leaf.name: _leaves.kind(leaf.value) for leaf in flat}


def _partial_steps(directory: str) -> list[int]:
  try:
    names = os.listdir(directory)
  except OSError:
    return []
  out = []
  for n in names:
    m = re.fullmatch(r'(\d+)' + re.escape(_TMP_SUFFIX) + r'.*', n)
    if m:
      out.append(int(m.group(1)))
  return sorted(out)


def _ensure_writable(directory: str) -> None:
  probe = os.path.join(
      directory, f'.write-probe-{jax.process_index()}-{os.getpid()}')
  try:
    os.makedirs(directory, exist_ok=True)
    with open(probe, 'w') as f:
      f.write('ok')
    os.remove(probe)
  except OSError as e:
    raise CheckpointError(
        f'{_prefix()} Checkpoint folder {directory} is not writable '
        f'({type(e).__name__}: {e.strerror or e}). Pick a folder this user can '
        'write, shared by every process (--checkpoint_dir).') from e


def _watched(op: str, fn: Callable[[], Any],
             explain: Callable[[Exception], str]) -> Any:
  """Runs an Orbax call that every process takes part in.

  Under the failure watchdog (`multihost.call_watched`), since Orbax's
  barriers would wait for a dead peer indefinitely: a dead peer raises
  `ProcessFailureError`; any other failure becomes a `CheckpointError` whose
  message is `explain(error)`.
  """
  try:
    return multihost.call_watched(fn, op=op)
  except multihost.ProcessFailureError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(explain(e)) from e


def quiet_orbax_logs() -> None:
  """Drops Orbax's INFO log lines (many per save) from absl's log handler.

  For binaries; warnings and errors from Orbax still show.
  """
  logging.get_absl_handler().addFilter(_not_orbax_info)


def _not_orbax_info(record) -> bool:
  return record.levelno >= logging.converter.STANDARD_WARNING or (
      f'{os.sep}orbax{os.sep}' not in record.pathname)
