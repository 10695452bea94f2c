"""The local tier's restore: the newest local step that is complete and passes its checks.

Candidates are tried newest first, down to the newest persistent step. One
that does not fit the target (another dtype, shape or tree: a config
mistake, not damage) raises `CheckpointMismatchError` on every process,
and nothing is renamed. One saved on another topology or sharding, or
with blocks that no host holds, is skipped. One whose reading, digest or
consistency check fails is damaged: it is noted (`Restored.damaged`, or
`tier.damaged` when none restores), never renamed here (the caller sets
it aside only where the run goes on past it), and, when `fall_back`, the
next older one is tried. For a step, each process reads what its host
holds; what it lacks comes from the lowest process of the first host (in
host order) that holds it, sent to that process alone
(`multihost.exchange`): each block moves once. A block a process
still lacks (or a sender cannot find) is a CheckpointError naming the
block, the step and the hosts, and the step is damaged like one that fails
a check. Every decision is taken from gathered facts, so all processes try
the same steps and take the same one, or all return None and the caller
falls back to the persistent tier.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from absl import logging
import numpy as np

import multihost
from multihost import process_prefix as _prefix
from recovery._src.local import folder
from recovery._src.local import layout as _layout
from recovery._src.local.folder import EntryKey
from recovery._src.state import consistency
from recovery._src.state import digest
from recovery._src.state import leaves
from recovery._src.state import meta as _meta
from recovery._src.state.errors import CheckpointError
from recovery._src.state.errors import shorten as _short
from recovery._src.state.state import TransitionState


@dataclasses.dataclass(frozen=True)
class Restored:
  """A restored local step, and what it took."""
  state: TransitionState
  step: int
  fetched: int  # bytes this process received from peers
  fetched_total: int  # bytes all processes received from peers
  failed: tuple[int, ...]  # newer complete local steps that failed a check


@dataclasses.dataclass(frozen=True)
class Damaged:
  """A local step that failed its reading, digest or consistency check (on some process): the same on every process."""
  step: int
  why: str


def restore(tier: Any, target: TransitionState, *, candidates: list[int],
            not_before: int | None, fall_back: bool = True
            ) -> Restored | None:
  """The newest local step in `candidates` (>= `not_before`) that restores.

  Collective: every process must call this, in the same order, after
  `tier.newest()` (whose inventory `tier.inventory` it reads). Returns None
  on every process when no such step restores (each reason is logged); the
  damaged steps passed over are appended to `tier.damaged` (nothing is
  renamed here). Without `fall_back`, it stops at the first damaged one.

  Raises:
    CheckpointMismatchError: a candidate does not fit `target` (on every
      process; nothing is renamed).
    CheckpointError: `target` holds a leaf that cannot be restored.
  """
  target_tree = target.to_tree()
  base = leaves.restore_target(target_tree)
  sig = _layout.topology(base)
  needs = [_layout.needed(base, p) for p in range(len(tier.hosts))]
  failed: list[int] = []
  for step in candidates:
    if not_before is not None and step < not_before:
      break
    info = tier.inventory[step]
    # A step that does not fit this run's state is the run's mistake, not
    # the step's: raised (on every process alike, from the same inventory).
    _fits(tier, step, info['meta'], target_tree)
    if info['topology'] != sig:
      logging.info('%s Local step %d was saved on another topology or '
                   'sharding; not restoring it from the local tier.',
                   _prefix(), step)
      continue
    missing = sorted({k[0] for need in needs for k in need
                      if k not in info['keys']})
    if missing:
      logging.info('%s Local step %d is incomplete across the hosts (no copy '
                   'of blocks of %s).', _prefix(), step, ', '.join(missing))
      continue
    got = _restore_step(tier, step, info, target, target_tree, needs)
    if not isinstance(got, str):
      state, fetched, total = got
      return Restored(state=state, step=step, fetched=fetched,
                      fetched_total=total, failed=tuple(failed))
    failed.append(step)
    tier.damaged.append(Damaged(step, got))
    if not fall_back:
      return None
    logging.warning('%s Local step %d failed its checks (%s); trying older '
                    'local steps (down to step %s) before the persistent '
                    'tier. It is set aside (kept) once a step restores.',
                    _prefix(), step, got, not_before)
  return None


def _fits(tier, step: int, meta: dict, target_tree) -> None:
  """Raises `CheckpointMismatchError` unless local `step`'s leaves fit the target's.

  Also `CheckpointError` when it names a digest algorithm this version does
  not check (on every process alike: the meta is the agreed inventory's).
  """
  _meta.check_algorithm(meta, where=f'Local checkpoint step {step} in '
                        f'{tier.local}')
  try:
    abstract = leaves.restore_target(target_tree, meta.get('leaves'))
  except TypeError as e:
    raise CheckpointError(
        f'{_prefix()} Cannot restore local step {step} onto this target: {e}'
    ) from None
  _meta.check_fits(meta, abstract,
                   where=f'Local checkpoint step {step} in {tier.local}')


def _restore_step(tier, step: int, info: dict, target: TransitionState,
                  target_tree, needs: list[set[EntryKey]]):
  """(state, bytes fetched here, bytes fetched in all) of `step`, or everywhere the (agreed) finding that it is damaged."""
  where = f'Local checkpoint step {step} in {tier.local}'
  transfers = []  # (source process, destination process, key): the same
  for p, need in enumerate(needs):  # list on every process.
    for key in sorted(need):
      holders = info['keys'][key]
      if tier.hosts[p] in holders:
        continue
      src_host = min(holders, key=tier.host_order.index)
      transfers.append((tier.lowest[src_host], p, key))
  error, blocks, meta = None, {}, info['meta']
  local_entries: dict[EntryKey, folder.Entry] = {}
  try:
    for s in folder.scan(tier.local):
      if s.step == step and tier.owns(s):
        for key, entry in s.entries.items():
          local_entries.setdefault(key, entry)
    for key in needs[tier.me]:
      if key in local_entries:
        blocks[key] = folder.read_block(local_entries[key])
  except Exception as e:  # pylint: disable=broad-except
    error = f'{type(e).__name__}: {_short(e)}'
  fetched = 0
  if transfers:
    # Every destination of this process gets its list (empty too): each
    # receiver names its senders.
    outgoing: dict[int, list[tuple[Any, np.ndarray]]] = {
        dst: [] for src, dst, _ in transfers if src == tier.me}
    for src, dst, key in transfers:
      if src != tier.me:
        continue
      if key not in blocks and key not in local_entries:
        missing = missing_block_error(tier, step, key, info['keys'][key],
                                      send_to=dst)
        error = error or f'{type(missing).__name__}: {missing}'
        continue
      try:
        outgoing[dst].append((key, blocks[key] if key in blocks else
                              folder.read_block(local_entries[key])))
      except Exception as e:  # pylint: disable=broad-except
        error = error or f'{type(e).__name__}: {_short(e)}'
    senders = {src for src, dst, _ in transfers if dst == tier.me}
    got = multihost.exchange(outgoing, recv_from=senders)
    for sent in got.values():
      for key, block in sent:
        blocks[key] = block
        fetched += block.nbytes
  restored = None
  if error is None:
    error = _missing(tier, step, info, needs[tier.me], blocks)
  if error is None:
    try:  # (It fits: `_fits`.) A block unlike its manifest is damage.
      abstract = leaves.restore_target(target_tree, meta.get('leaves'))
      restored = _layout.assemble(abstract, blocks, where=where)
    except Exception as e:  # pylint: disable=broad-except
      error = f'{type(e).__name__}: {_short(e)}'
  # (With every process's bytes from peers, for the log.)
  gathered = multihost.allgather_object((error, fetched))
  total = sum(n for _, n in gathered)
  failed = _failed(where, 'reading it', [e for e, _ in gathered])
  if failed:
    return f'it failed reading: {failed}'
  if restored is None:  # (no error anywhere: this process assembled it)
    raise CheckpointError(f'{_prefix()} {where}: nothing was assembled, '
                          'though no process failed reading it.')
  algorithm = meta['digest_algorithm']  # (Checked by `_fits`.)
  digests = digest.checkpoint_leaf_digests(restored, algorithm=algorithm)
  got = digest.combine(digests, algorithm=algorithm)
  error = (None if got == meta['digest'] else
           f'its blocks digest to {got[:16]}..., not the saved '
           f'{meta["digest"][:16]}... (leaves that changed: '
           f'{", ".join(_meta.changed_leaves(meta, digests)) or "unknown"})')
  failed = _agree(error, where, 'its digest check')
  if failed:
    return f'it failed its digest check: {failed}'
  try:
    consistency.check_consistent(
        restored, what=f'After restoring local step {step}', digests=digests)
  except multihost.ConsistencyError as e:  # raised on every process
    logging.error('%s %s: %s', _prefix(), where, _short(e))
    return 'the processes restored different states'
  state = TransitionState.from_tree(
      leaves.rebuild(target_tree, restored), key_like=target.key)
  return state, fetched, total


def missing_block_error(tier, step: int, key: EntryKey, holders: list[str],
                        *, others: int = 0,
                        send_to: int | None = None) -> CheckpointError:
  """The error for a block of `step` that this process cannot find: names the block, the step and the hosts.

  `send_to`: the process this one was to send it to (else it needed it
  itself); `others`: how many more blocks are missing here.
  """
  named = ', '.join(tier.host_names.get(h, h) for h in holders) or 'no host'
  why = (f'was to send it to process {send_to}, but its local folder holds '
         'no such block' if send_to is not None else 'neither reads it '
         'from its local folder nor received it from a peer')
  more = f' ({others} more blocks are missing)' if others else ''
  return CheckpointError(
      f'Block {key[0]} {list(key[1])} of local step {step} is missing on '
      f'process {tier.me} (host {tier.host_names.get(tier.host, tier.host)}, '
      f'local folder {tier.local}): the hosts\' lists name it on {named}, '
      f'but this process {why}{more}. The step is skipped: older local '
      'steps, then the persistent tier, are tried. If '
      f'${_layout.HOST_ID_VARIABLE} is set, processes given one value must '
      'share one local folder; unset it to let the folders tell the hosts '
      'apart.')


def _missing(tier, step: int, info: dict, need: set[EntryKey],
             blocks: dict) -> str | None:
  """None if this process has every block it needs, else the error (a CheckpointError's text)."""
  missing = sorted(k for k in need if k not in blocks)
  if not missing:
    return None
  e = missing_block_error(tier, step, missing[0],
                          info['keys'].get(missing[0], []),
                          others=len(missing) - 1)
  return f'{type(e).__name__}: {e}'


def _agree(error: str | None, where: str, during: str) -> str | None:
  """None if no process saw an error, else the first ones (logged everywhere), the same on every process."""
  return _failed(where, during, multihost.allgather_object(error))


def _failed(where: str, during: str, errors: list) -> str | None:
  """None if no process's entry of `errors` is an error, else the first ones (logged)."""
  failed = [(p, e) for p, e in enumerate(errors) if e is not None]
  if not failed:
    return None
  found = '; '.join(f'process {p}: {e}' for p, e in failed[:4])
  logging.error('%s %s failed %s on %s.', _prefix(), where, during, found)
  return found
