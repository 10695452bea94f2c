"""The local checkpoint tier: each host saves what it holds, with peer copies.

Every `every` steps each process writes, to its host's own local folder
(`_local_folder`), only the blocks it holds: its addressable shards of
arrays sharded across processes, and every other leaf (replicated arrays,
host values) once per host, by the lowest process index of that host that
holds it. A block that lives on one host only is also copied to the next
host in the ring (hosts ordered by their lowest process index), through
`multihost.allgather_object` (sealed with the job secret), so losing any one
host's local disk loses nothing. The files are written by a background
thread; the training step only waits for the (collective) consistency check,
the copy to host memory and the peer exchange.

A restore gathers every host's list of committed local steps and the blocks
each holds, takes the newest step from which every process can rebuild its
part of the target on this topology, fetches what a host lacks from the
holders, then checks the digests as a persistent restore does. Every
decision is taken from gathered facts, so all processes take the same one;
any failure returns None on every process, and the caller falls back to the
persistent tier.
"""

from __future__ import annotations

from concurrent import futures
import functools
import hashlib
import os
import socket
import time
from typing import Any

from absl import logging
import jax
import numpy as np

import multihost
from multihost.lowlevel import process_prefix as _prefix
from multihost.lowlevel import shorten as _short
from recovery import _consistency
from recovery import _digest
from recovery import _leaves
from recovery import _local_folder
from recovery import _meta
from recovery._local_folder import EntryKey
from recovery._state import TransitionState

PyTree = Any

# Overrides the host name that tells hosts apart, for containers whose
# hostnames repeat, and for drills that simulate several hosts on one.
HOST_ID_VARIABLE = 'RECOVERY_HOST_ID'


def host_id() -> str:
  """This process's host: $RECOVERY_HOST_ID, else the hostname."""
  return os.environ.get(HOST_ID_VARIABLE, '').strip() or socket.gethostname()


def _index_key(index: tuple, shape: tuple[int, ...]) -> tuple:
  return tuple((s.indices(n)[0], s.indices(n)[1])
               for s, n in zip(index, shape, strict=True))


@functools.lru_cache(maxsize=256)
def _array_layout(sharding: jax.sharding.Sharding,
                  shape: tuple[int, ...]) -> tuple[dict, tuple]:
  """({index key: processes holding it}, (device id, process, key) sorted)."""
  holders: dict[tuple, set[int]] = {}
  placed = []
  for device, index in sharding.devices_indices_map(shape).items():
    key = _index_key(index, shape)
    holders.setdefault(key, set()).add(device.process_index)
    placed.append((device.id, device.process_index, key))
  return ({k: frozenset(v) for k, v in holders.items()}, tuple(sorted(placed)))


def _is_placed(x: Any) -> bool:
  """Whether a storable (or abstract) leaf is a global array on a sharding."""
  return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and getattr(
      x, 'sharding', None) is not None


def _named_leaves(tree) -> list[tuple[str, Any]]:
  return [(_digest.path_name(p), x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def topology(tree) -> str:
  """A digest of where each placed leaf's blocks live (devices, processes).

  Equal for a saving run and a restoring run on the same topology and
  shardings; an elastic restore (other processes, devices or shardings)
  differs, and takes the persistent tier.
  """
  h = hashlib.sha256(f'{jax.process_count()}/{jax.device_count()}'.encode())
  for name, x in _named_leaves(tree):
    if _is_placed(x):
      h.update(repr((name, tuple(x.shape),
                     _array_layout(x.sharding, tuple(x.shape))[1])).encode())
  return h.hexdigest()


def _needed(tree, process: int) -> set[EntryKey]:
  """The blocks `process` needs to rebuild its part of `tree`."""
  out = set()
  for name, x in _named_leaves(tree):
    if _is_placed(x):
      for _, p, key in _array_layout(x.sharding, tuple(x.shape))[1]:
        if p == process:
          out.add((name, key))
    else:
      out.add((name, ()))
  return out


class LocalTier:
  """One run's local checkpoint tier (see the module docstring).

  Constructing it is a collective (every process learns every process's
  host): every process must construct it, in the same order.
  """

  def __init__(self, local_directory: str | os.PathLike, *, directory: str,
               every: int, keep: int = 2):
    if every < 1 or keep < 1:
      raise ValueError(
          f'local_save_every and local_keep must be >= 1; got '
          f'local_save_every={every}, local_keep={keep}.')
    self.local = os.path.abspath(os.fspath(local_directory))
    self.directory = directory
    self.every = int(every)
    self.keep = int(keep)
    self.me = jax.process_index()
    os.makedirs(_local_folder.process_folder(self.local, self.me),
                exist_ok=True)
    _local_folder.remove_tmp(self.local, self.me)
    self.hosts: list[str] = list(multihost.allgather_object(host_id()))
    order: list[str] = []
    for h in self.hosts:
      if h not in order:
        order.append(h)
    self.host_order = order
    self.host = self.hosts[self.me]
    self.lowest = {h: self.hosts.index(h) for h in order}
    self.successor = (order[(order.index(self.host) + 1) % len(order)]
                      if len(order) > 1 else None)
    self._pool = futures.ThreadPoolExecutor(
        1, thread_name_prefix='recovery-local-save')
    self._writing: futures.Future | None = None
    self.last_saved: int | None = None
    self.restored_bytes_from_peers = 0
    self.saves = 0
    self.save_seconds = 0.0  # spent by `save` on the calling thread
    self.peer_bytes_sent = 0

  # -- save ------------------------------------------------------------------

  def due(self, step: int) -> bool:
    return step > 0 and step % self.every == 0 and step != self.last_saved

  def save(self, state: TransitionState) -> None:
    """Saves `state` to this host's local folder (the files in the background).

    Collective: every process must call this, in the same order.

    Raises:
      multihost.ConsistencyError: the controllers hold different states.
    """
    step, t0 = state.step, time.monotonic()
    raw = state.to_tree()
    tree = _leaves.storable(raw)
    digests = _consistency.check_consistent(
        tree, what=f'Before the local save of step {step}')
    meta = _meta.build(state, raw, tree, digests, reason='local')
    own, sends, peers_needed = [], [], False
    for name, x in _named_leaves(tree):
      if _is_placed(x):
        holders, _ = _array_layout(x.sharding, tuple(x.shape))
        mine = {}
        for shard in x.addressable_shards:
          mine.setdefault(_index_key(shard.index, tuple(x.shape)), shard.data)
      else:
        holders = {(): frozenset(range(len(self.hosts)))}
        mine = {(): x}
      for key, where in holders.items():
        on_hosts = {self.hosts[p] for p in where}
        single = len(on_hosts) == 1 and self.successor is not None
        peers_needed |= single
        if key not in mine:
          continue
        writer = min(p for p in where if self.hosts[p] == self.host)
        if writer != self.me:
          continue
        block = np.asarray(mine[key])
        own.append(((name, key), block))
        if single:
          sends.append(((name, key), block))
    peer_blocks = []
    if peers_needed:  # The same decision on every process (global layout).
      gathered = multihost.allgather_object(sends)
      self.peer_bytes_sent += sum(b.nbytes for _, b in sends)
      if self.me == self.lowest[self.host]:
        for p, blocks in enumerate(gathered):
          if p != self.me and self._successor_of(self.hosts[p]) == self.host:
            peer_blocks.extend(blocks)
    manifest = {'directory': self.directory, 'host': self.host,
                'topology': topology(tree), 'meta': meta,
                'peer_keys': [[k[0], [list(i) for i in k[1]]]
                              for k, _ in peer_blocks]}
    self.wait()
    self._writing = self._pool.submit(self._write, step, manifest,
                                      own + peer_blocks)
    self.last_saved = step
    self.saves += 1
    spent = time.monotonic() - t0
    self.save_seconds += spent
    logging.info(
        '%s Local save of step %d to %s: %d own and %d peer bytes, %d bytes '
        'sent to a peer, %.3f s on the training thread (the files are written '
        'in the background).', _prefix(), step, self.local,
        sum(b.nbytes for _, b in own), sum(b.nbytes for _, b in peer_blocks),
        sum(b.nbytes for _, b in sends), spent)

  def _successor_of(self, host: str) -> str | None:
    order = self.host_order
    if len(order) < 2:
      return None
    return order[(order.index(host) + 1) % len(order)]

  def _write(self, step: int, manifest: dict, blocks: list) -> None:
    t0 = time.monotonic()
    written = _local_folder.write_step(self.local, self.me, step, manifest,
                                       blocks)
    _local_folder.prune(self.local, self.me, self.keep)
    logging.debug('%s Local step %d: %d bytes written to %s in %.3f s.',
                  _prefix(), step, written, self.local,
                  time.monotonic() - t0)

  def wait(self) -> None:
    """Waits for the local save in flight; a failed one is logged, not raised.

    The local tier is a faster way back, not the record: a failed local
    write leaves the persistent tier (and older local steps) to restore from.
    """
    writing, self._writing = self._writing, None
    if writing is None:
      return
    try:
      writing.result()
    except Exception as e:  # pylint: disable=broad-except
      logging.error('%s A local save to %s failed (%s: %s); restores fall '
                    'back to older local steps or the persistent tier. Check '
                    'that the folder is writable and has space.', _prefix(),
                    self.local, type(e).__name__, _short(e))

  def close(self) -> None:
    self.wait()
    self._pool.shutdown(wait=True)

  def forget(self) -> None:
    """A fresh run: deletes this host's local steps of the same checkpoint folder.

    Left in place, an older run's local steps would be restored on this
    run's first restart. Run by the lowest process of each host; local.
    """
    if self.me != self.lowest[self.host]:
      return
    stale = [s for s in _local_folder.scan(self.local)
             if s.manifest.get('directory') == self.directory]
    if stale:
      logging.warning('%s Fresh start: deleting %d local steps of an earlier '
                      'run on %s from %s.', _prefix(), len(stale),
                      self.directory, self.local)
      _local_folder.remove_steps(stale)

  # -- restore ---------------------------------------------------------------

  def newest(self) -> tuple[int | None, list]:
    """The newest step restorable from the local tiers, and what each holds.

    Collective: every process must call this, in the same order. The step
    is the same on every process; None when there is none. (Its topology is
    checked by `restore`.)
    """
    stored = _local_folder.scan(self.local)
    mine: dict[int, dict] = {}
    for s in stored:
      if s.manifest.get('directory') != self.directory:
        continue
      info = mine.setdefault(s.step, {
          'digest': s.manifest['meta']['digest'],
          'topology': s.manifest.get('topology'), 'keys': set(),
          'meta': s.manifest['meta'], 'conflict': False})
      if (info['digest'] != s.manifest['meta']['digest']
          or info['topology'] != s.manifest.get('topology')):
        info['conflict'] = True
      info['keys'] |= set(s.entries)
    inventories = multihost.allgather_object({'host': self.host,
                                              'steps': mine})
    self._inventories = inventories
    by_host: dict[str, dict] = {}
    for inv in inventories:
      by_host.setdefault(inv['host'], inv['steps'])
    steps: dict[int, dict] = {}
    for host, held in by_host.items():
      for step, info in held.items():
        agg = steps.setdefault(step, {'digest': info['digest'],
                                      'topology': info['topology'],
                                      'meta': info['meta'],
                                      'keys': {}, 'conflict': False})
        agg['conflict'] |= (info['conflict']
                            or agg['digest'] != info['digest']
                            or agg['topology'] != info['topology'])
        for key in info['keys']:
          agg['keys'].setdefault(key, []).append(host)
    self._steps = steps
    usable = sorted((s for s, i in steps.items() if not i['conflict']),
                    reverse=True)
    return (usable[0] if usable else None), usable

  def restore(self, target: TransitionState, *, candidates: list[int],
              not_before: int | None) -> tuple[TransitionState, int] | None:
    """The newest complete local step in `candidates` (>= `not_before`), restored.

    Collective: every process must call this, in the same order, after
    `newest`. Returns (state, bytes fetched from peers by this process), or
    None on every process when no local step is complete for this topology
    or the restore fails its checks (the reason is logged).
    """
    target_tree = target.to_tree()
    base = _leaves.restore_target(target_tree)
    sig = topology(base)
    needs = [_needed(base, p) for p in range(len(self.hosts))]
    step = None
    for s in candidates:
      if not_before is not None and s < not_before:
        break
      info = self._steps[s]
      if info['topology'] != sig:
        logging.info('%s Local step %d was saved on another topology or '
                     'sharding; not restoring from the local tier.',
                     _prefix(), s)
        continue
      if all(k in info['keys'] for need in needs for k in need):
        step = s
        break
      missing = sorted({k[0] for need in needs for k in need
                        if k not in info['keys']})
      logging.info('%s Local step %d is incomplete across the hosts (no copy '
                   'of blocks of %s).', _prefix(), s, ', '.join(missing))
    if step is None:
      return None
    info = self._steps[step]
    where = f'Local checkpoint step {step} in {self.local}'
    # Who sends what: each block a process lacks on its host comes from the
    # lowest process of the first host (in host order) that holds it.
    transfers = []
    for p, need in enumerate(needs):
      for key in sorted(need):
        holders = info['keys'][key]
        if self.hosts[p] in holders:
          continue
        src_host = min(holders, key=self.host_order.index)
        transfers.append((self.lowest[src_host], p, key))
    error, blocks, meta = None, {}, info['meta']
    local_entries: dict[EntryKey, _local_folder.Entry] = {}
    try:
      for s in _local_folder.scan(self.local):
        if s.step == step and s.manifest.get('directory') == self.directory:
          for key, entry in s.entries.items():
            local_entries.setdefault(key, entry)
      for key in needs[self.me]:
        if key in local_entries:
          blocks[key] = _local_folder.read_block(local_entries[key])
    except Exception as e:  # pylint: disable=broad-except
      error = f'{type(e).__name__}: {_short(e)}'
    fetched = 0
    if transfers:  # The same list on every process.
      outgoing = []
      for src, dst, key in transfers:
        if src == self.me:
          try:
            outgoing.append((dst, key, blocks[key] if key in blocks else
                             _local_folder.read_block(local_entries[key])))
          except Exception as e:  # pylint: disable=broad-except
            error = error or f'{type(e).__name__}: {_short(e)}'
      for sent in multihost.allgather_object(outgoing):
        for dst, key, block in sent:
          if dst == self.me:
            blocks[key] = block
            fetched += block.nbytes
    restored = None
    if error is None:
      try:
        abstract = _leaves.restore_target(target_tree, meta.get('leaves'))
        _meta.check_fits(meta, abstract, where=where)
        restored = _assemble(abstract, blocks)
      except Exception as e:  # pylint: disable=broad-except
        error = f'{type(e).__name__}: {_short(e)}'
    if not self._agree(error, where, 'reading it'):
      return None
    digests = _digest.checkpoint_leaf_digests(restored)
    got = _digest.combine(digests)
    error = (None if got == meta['digest'] else
             f'its blocks digest to {got[:16]}..., not the saved '
             f'{meta["digest"][:16]}...')
    if not self._agree(error, where, 'its digest check'):
      return None
    try:
      _consistency.check_consistent(
          restored, what=f'After restoring local step {step}', digests=digests)
    except multihost.ConsistencyError as e:  # raised on every process
      logging.error('%s %s: %s Falling back to the persistent tier.',
                    _prefix(), where, _short(e))
      return None
    state = TransitionState.from_tree(
        _leaves.rebuild(target_tree, restored), key_like=target.key)
    self.restored_bytes_from_peers = fetched
    self.last_saved = step
    return state, fetched

  def _agree(self, error: str | None, where: str, during: str) -> bool:
    """Whether no process saw an error; the first ones are logged everywhere."""
    errors = multihost.allgather_object(error)
    failed = [(p, e) for p, e in enumerate(errors) if e is not None]
    if failed:
      logging.error(
          '%s %s failed %s on %s; falling back to the persistent tier.',
          _prefix(), where, during,
          '; '.join(f'process {p}: {e}' for p, e in failed[:4]))
    return not failed


def _assemble(abstract, blocks: dict[EntryKey, np.ndarray]):
  """The storable tree, each placed leaf built from this process's blocks."""

  def leaf(path, x):
    name = _digest.path_name(path)
    if _is_placed(x):
      shape = tuple(x.shape)
      arrays = []
      for device, index in x.sharding.addressable_devices_indices_map(
          shape).items():
        block = blocks[(name, _index_key(index, shape))]
        if block.dtype != np.dtype(x.dtype):
          raise TypeError(f'block of {name} has dtype {block.dtype}, the '
                          f'target {np.dtype(x.dtype)}')
        arrays.append(jax.device_put(block, device))
      return jax.make_array_from_single_device_arrays(shape, x.sharding,
                                                      arrays)
    return np.asarray(blocks[(name, ())])

  return jax.tree_util.tree_map_with_path(leaf, abstract)
