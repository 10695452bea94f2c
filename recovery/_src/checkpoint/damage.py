"""Damaged steps: reading a persistent one with every process agreeing whether it is damaged, setting them aside, noting each folder set aside (either tier).

`read` restores a committed step of a `Checkpoints` onto a target, or
returns the agreed finding (`Damage`) that the step is damaged: its meta
item or its files cannot be read, or it fails its digest check, on some
process. `set_aside` renames damaged steps to `<step>.damaged-<UTC time>`
(kept, never read or deleted). Both are collectives; `Checkpoints.restore`
and `Checkpoints.start` (`resume.begin`) use them. They act on the
`Checkpoints`' own parts (its Orbax manager, its committed steps).
`record` is where every folder set aside, persistent or local, is noted
(`Checkpoints.set_aside`, one `SetAside` each) and reported as an event.
"""

# pylint: disable=protected-access

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any

from absl import logging
import jax
import numpy as np

import multihost
from multihost import process_prefix as _prefix
from multihost import record_event as _record_event
from recovery._src.checkpoint import carrier
from recovery._src.checkpoint import folder
from recovery._src.checkpoint import manager
from recovery._src.checkpoint import read_once
from recovery._src.state import consistency
from recovery._src.state import leaves
from recovery._src.state import meta as _meta
from recovery._src.state.errors import CheckpointCorruptError
from recovery._src.state.errors import CheckpointDamagedError
from recovery._src.state.errors import CheckpointError
from recovery._src.state.errors import CheckpointFolderError
from recovery._src.state.errors import shorten as _short
from recovery._src.state.state import TransitionState


@dataclasses.dataclass(frozen=True)
class Damage:
  """The agreed finding that committed persistent step `step` is damaged.

  `step` and `why` are the same on every process; `error` is what this
  process raises when the step is not set aside.
  """
  step: int
  why: str
  error: CheckpointDamagedError


@dataclasses.dataclass(frozen=True)
class SetAside:
  """A damaged checkpoint folder that `Checkpoints.start` renamed aside: kept, never read or deleted.

  Attributes:
    step: the step it holds.
    tier: 'persistent' (the step's folder in the checkpoint folder) or
      'local' (this process's folder of a local step).
    path: its new path, `<step>.damaged-<UTC time>` (persistent) or
      `<step>-<run>.damaged-<UTC time>` (local), beside the steps.
  """
  step: int
  tier: str
  path: str


def record(ckpt: Any, aside: SetAside, t0: float, *, why: str,
           resumed_from: int | None) -> None:
  """Notes a folder set aside, of either tier: appends it to `ckpt.set_aside` and records a 'checkpoint set aside' event (since `t0`)."""
  ckpt.set_aside.append(aside)
  _record_event('checkpoint set aside', t0, step=aside.step, tier=aside.tier,
                moved_to=aside.path, why=why, resumed_from=resumed_from)


def read(ckpt: Any, target: TransitionState,
         step: int) -> TransitionState | Damage:
  """Restores committed `step` onto `target`, or the agreed finding that it is damaged.

  Collective: every process must call this, in the same order. Every
  process returns the restored state, or every process a `Damage` of
  `step`: its meta item or its files cannot be read, or it fails its
  digest check, on some process (agreed after each of these reads, one
  agreement of a flag each, `_agree`).

  Raises:
    What `Checkpoints.restore` raises, but `CheckpointDamagedError`.
  """
  start = time.monotonic()
  where = f'Checkpoint step {step} in {ckpt.directory}'
  meta, error = None, None
  try:
    meta = ckpt.read_meta(step)
  except CheckpointDamagedError as e:
    error = e
  damage = _agree(ckpt, step, error)
  if damage is not None:
    return damage
  if meta is None:  # (no process failed reading it: this one read it)
    raise CheckpointError(f'{_prefix()} {where}: its metadata was not read, '
                          'though no process failed reading it.')
  target_tree = target.to_tree()
  recorded = meta.get('storage')  # None: saved before it was recorded.
  try:
    abstract = leaves.restore_target(target_tree, meta.get('leaves'))
    read_as = carrier.encode_abstract(abstract, recorded)
  except TypeError as e:
    raise CheckpointError(
        f'{_prefix()} Cannot restore step {step} onto this target: {e}'
    ) from None
  _meta.check_fits(meta, abstract, where=where)
  restored, error = None, None
  readers = (read_once.plan(read_as, jax.process_count())
             if ckpt.read_once and jax.process_count() > 1 else None)
  try:
    if readers is None:
      restore = functools.partial(
          ckpt._manager.restore, step,
          args=manager.restore_args(read_as))
    else:
      if ckpt._reader is None:
        ckpt._reader = manager.reader()
      restore = functools.partial(
          lambda *a: {manager.STATE_ITEM: read_once.read(*a)},
          ckpt.directory, step, read_as, readers, ckpt._reader)
    before = read_once.bytes_read()
    restored = manager.watched(
        f'restore checkpoint step {step}', restore,
        lambda e: f'{type(e).__name__}: {_short(e)}')[manager.STATE_ITEM]
    after = read_once.bytes_read()
    ckpt.read_from_storage = (None if before is None or after is None
                              else after - before)
  except CheckpointError as e:
    error = CheckpointDamagedError(
        f'{_prefix()} {where} cannot be read: {e}. The files are damaged '
        f'or incomplete. {ckpt._fallback_hint(step)}',
        why=f'its files cannot be read ({e})')
    error.__cause__ = e.__cause__
  # A process whose read failed skips Orbax's closing barrier, where the
  # others then wait up to its timeout before they fail too and get here
  # (with read_once there is no such barrier; a process still reading is
  # waited for here).
  damage = _agree(ckpt, step, error, timeout=multihost.default_timeout()
                  + manager.ORBAX_BARRIER_TIMEOUT_S)
  if damage is not None:
    return damage
  if readers is not None:  # Every process has read its part: no one waits.
    restored = read_once.share(restored, read_as, readers)
  restored = carrier.decode(restored, abstract, recorded)
  digests, error = None, None
  try:
    digests = _meta.check_digest(meta, restored, where=where,
                                 hint=ckpt._fallback_hint(step))
  except CheckpointDamagedError as e:
    error = e
  damage = _agree(ckpt, step, error)
  if damage is not None:
    return damage
  consistency.check_consistent(
      restored, what=f'After restoring step {step}', digests=digests)
  state = TransitionState.from_tree(
      leaves.rebuild(target_tree, restored), key_like=target.key)
  if state.step != step:  # The same on every process (checked just above).
    why = f'it holds a state at step {state.step}'
    return Damage(step, why, CheckpointCorruptError(
        f'{_prefix()} Checkpoint folder {step} holds a state at step '
        f'{state.step}. {ckpt._fallback_hint(step)}', why=why))
  _record_event('checkpoint restore', start, step=step, tier='shared',
                bytes=sum(x.nbytes for x in jax.tree.leaves(restored)),
                read_from_storage=ckpt.read_from_storage,
                read_once=readers is not None)
  logging.info('%s Restored checkpoint step %d (epoch %d, cursor %d, '
               'digest %s...) from %s onto %d processes, %d devices.',
               _prefix(), step, state.epoch, state.cursor,
               meta['digest'][:12], ckpt.directory, jax.process_count(),
               jax.device_count())
  return state


def _agree(ckpt: Any, step: int, error: CheckpointDamagedError | None, *,
           timeout: float | None = None) -> Damage | None:
  """The `Damage` of `step` if this or any process found it damaged, else None.

  Collective: every process must call this, in the same order (one
  agreement of whether any process found damage; then, if one did, an
  all-gather of the findings). Every process gets the same finding (the
  first failing process's), with its own error to raise: the one it hit,
  or, where it found nothing, one naming the processes that did.
  """
  mine = None if error is None else error.why
  # Whether any process found damage, in one agreement of a flag (ceil(log2
  # P) messages a process, where an all-gather moves P findings to every
  # process); the findings move only when some process found one.
  try:
    multihost.assert_equal(np.uint8(mine is not None), timeout=timeout)
    if mine is None:
      return None  # Every process found nothing.
  except multihost.ConsistencyError:
    pass  # Some did, some did not.
  whys = multihost.allgather_object(mine, timeout=timeout)
  failed = [p for p, why in enumerate(whys) if why is not None]
  if not failed:
    return None
  why = whys[failed[0]]
  if jax.process_count() > 1:
    why += f' (on process(es) {failed})'
  if error is None:
    error = CheckpointDamagedError(
        f'{_prefix()} Checkpoint step {step} in {ckpt.directory} is '
        f'damaged: {why}. {ckpt._fallback_hint(step)}', why=why)
  return Damage(step, why, error)


def set_aside(ckpt: Any, damaged: list[Damage], *, instead: int,
              resumed_tier: str) -> None:
  """Renames each damaged step to `<step>.damaged-<UTC time>` in the folder; says so on every process.

  Collective: every process must call this, in the same order, with the
  same (agreed) `damaged`. Only process 0 renames (the folder is shared,
  and it holds the folder's lock); one broadcast gives every process the
  new names, or process 0's error. Nothing is deleted. Orbax, keep-N and
  the folder's scan see no such name as a step (it is not all digits).
  Each one moved is noted (`record`), as resuming from `resumed_tier`'s
  step `instead`.

  Raises:
    CheckpointFolderError: process 0 could not rename one (on every
      process, naming it).
  """
  if not damaged:
    return
  t0 = time.monotonic()
  moved, error = {}, None
  if jax.process_index() == 0:
    for d in damaged:
      try:
        moved[d.step] = folder.set_aside(ckpt.directory, d.step)
      except OSError as e:
        error = (f'Process 0 could not set damaged checkpoint step {d.step} '
                 f'aside: renaming {os.path.join(ckpt.directory, str(d.step))}'
                 f' failed ({type(e).__name__}: {e.strerror or e}). Move it '
                 'out of the folder by hand (or make the folder writable), '
                 'then start again.')
        break
  moved, error = multihost.broadcast_object((moved, error))
  ckpt._manager.reload()  # Orbax's list of steps, without the moved ones
  ckpt._committed = [s for s in ckpt._committed if s not in moved]
  for d in damaged:
    if d.step not in moved:
      continue
    logging.warning(
        '%s Checkpoint step %d in %s is damaged: %s. Set it aside as %s '
        '(kept, never read or deleted); resuming from %s step %d instead.',
        _prefix(), d.step, ckpt.directory, d.why, moved[d.step],
        resumed_tier, instead)
    record(ckpt, SetAside(d.step, 'persistent', moved[d.step]), t0,
           why=d.why, resumed_from=instead)
  if error:
    raise CheckpointFolderError(f'{_prefix()} {error}')


def stored_tree(ckpt, step: int) -> Any:
  """`Checkpoints.stored_tree`: zeros of the stored shapes and saved dtypes, or CheckpointDamagedError."""
  try:
    specs = ckpt.read_meta(step).get('leaves', {})
  except CheckpointError:
    specs = {}  # The restore names what is wrong.
  try:
    meta = ckpt._manager.item_metadata(step)[manager.STATE_ITEM]
    tree = meta.tree if hasattr(meta, 'tree') else meta

    def zeros(path, m):
      spec = specs.get(leaves.path_name(path))
      dtype = leaves.spec_dtype(spec) if spec else m.dtype
      return np.zeros(m.shape, dtype)

    return jax.tree_util.tree_map_with_path(zeros, tree)
  except Exception as e:  # pylint: disable=broad-except
    finding = f'unreadable array metadata ({type(e).__name__}: {_short(e)})'
    raise CheckpointDamagedError(
        f'{_prefix()} Checkpoint step {step} in {ckpt.directory} has '
        f'{finding}. {ckpt._fallback_hint(step)}', why=f'it has {finding}'
    ) from e
