"""The local checkpoint tier: each host saves what it holds, with peer copies.

Every `every` steps each process writes, to its host's own local folder
(`local.folder`), only the blocks it holds: its addressable shards of
arrays sharded across processes, and every other leaf (replicated arrays,
host values) once per host, by the lowest process index of that host that
holds it. A host is the set of processes that share one local folder: they
find each other through the folder itself (`private.folder_id`, a random
identity kept in it), never by hostname, so processes with a disk each
under one hostname are hosts of their own, and processes on one disk are
one host; $RECOVERY_HOST_ID overrides the folder's identity. A block that
lives on one host only is also copied to the next host in the ring (hosts
ordered by their lowest process index): each process sends its blocks to
that host's lowest process alone (`multihost.exchange`: out of band, so
whatever the size of a host's blocks, and no byte to any other host), so
losing any one host's local disk loses nothing. The files are written by a background
thread; the training step only waits for the (collective) consistency check,
the copy to host memory (made before `save` returns, so the caller may update
its arrays in place at once) and the peer exchange. A local save that fails
is logged and recorded, never raised: the persistent tier is the record.

Local steps belong to a run: each carries the run's identity (`run_identity`),
and a run restores, prunes and replaces only its own steps.

A restore gathers every host's list of committed local steps and the blocks
each holds (`newest`), then restores the newest one that is complete on
this topology and passes its checks (`local.restore`).
"""

from __future__ import annotations

from concurrent import futures
import os
import time

from absl import logging
import jax

import multihost
from multihost import process_prefix as _prefix
from multihost import record_event as _record_event
from recovery._src.local import folder
from recovery._src.local import layout as _layout
from recovery._src.local import private
from recovery._src.local import restore as _local_restore
from recovery._src.local import run_identity
from recovery._src.local.layout import HOST_ID_VARIABLE as HOST_ID_VARIABLE
from recovery._src.state import consistency
from recovery._src.state import leaves
from recovery._src.state import meta as _meta
from recovery._src.state.errors import CheckpointFolderError
from recovery._src.state.errors import shorten as _short
from recovery._src.state.state import TransitionState


def _raise_agreed(errors: list[str | None], what: str) -> None:
  """Raises CheckpointFolderError on every process if any process failed."""
  failed = [(p, e) for p, e in enumerate(errors) if e]
  if not failed:
    return
  mine = errors[jax.process_index()]
  raise CheckpointFolderError(
      f'{_prefix()} {mine}' if mine else
      f'{_prefix()} {what} failed on ' + '; '.join(
          f'process {p}: {e}' for p, e in failed[:4]))


class LocalTier:
  """One run's local checkpoint tier (see the module docstring).

  Constructing it is a collective (every process learns every process's
  host: its local folder's identity, or $RECOVERY_HOST_ID): every process
  must construct it, in the same order.
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
    error, runs, local_id = None, None, None
    try:
      folder.prepare(self.local, self.me)
      local_id = private.folder_id(self.local)
    except CheckpointFolderError as e:
      error = str(e)
    if self.me == 0:  # Holds the checkpoint folder's lock.
      stored, fresh = run_identity.read(directory), run_identity.new()
      if stored is None:  # A new folder (or one of an older version).
        error = error or run_identity.write(directory, fresh)
      runs = (stored or fresh, fresh)
    # Who shares a local folder is what the folder says (its identity), not
    # the hostname: hostnames repeat across containers and namespaces with
    # a disk each. $RECOVERY_HOST_ID overrides it.
    gathered = multihost.allgather_object(
        {'host': _layout.host_id(local_id or ''), 'folder': local_id,
         'hostname': _layout.hostname(), 'error': error, 'runs': runs})
    _raise_agreed([g['error'] for g in gathered], 'Starting the local tier')
    self.hosts: list[str] = [g['host'] for g in gathered]
    # This run's identity (the stored one: a restart's), and the one a fresh
    # start takes (`forget`); the same on every process.
    self.run, self._fresh_run = gathered[0]['runs']
    folder.remove_tmp(self.local, self.me, self.run)
    order: list[str] = []
    for h in self.hosts:
      if h not in order:
        order.append(h)
    self.host_order = order
    self.host = self.hosts[self.me]
    self.lowest = {h: self.hosts.index(h) for h in order}
    # For messages: each host with its processes and their hostnames.
    self.host_names: dict[str, str] = {}
    for h in order:
      ps = [p for p, g in enumerate(self.hosts) if g == h]
      names = sorted({gathered[p]['hostname'] for p in ps})
      self.host_names[h] = (f'{h} (process{"es" if len(ps) > 1 else ""} '
                            f'{", ".join(map(str, ps))} on '
                            f'{", ".join(names)})')
    if self.me == 0:
      _layout.warn_if_overridden_apart(gathered)
    self.successor = self._successor_of(self.host)
    self._pool = futures.ThreadPoolExecutor(
        1, thread_name_prefix='recovery-local-save')
    self._writing: tuple[int, futures.Future] | None = None  # (step, write)
    self.last_saved: int | None = None
    self.restored_bytes_from_peers = 0
    self.inventory: dict[int, dict] = {}  # by `newest`: step -> what is where
    # Local steps a restore found damaged (`local.restore.Damaged`), the same
    # on every process: set aside by `start` once a step past them restores.
    self.damaged: list[_local_restore.Damaged] = []
    self.saves = 0
    self.failed_saves = 0  # local saves that failed (logged and recorded)
    self.save_seconds = 0.0  # spent by `save` on the calling thread
    self.peer_bytes_sent = 0

  # -- save ------------------------------------------------------------------

  def due(self, step: int) -> bool:
    return step > 0 and step % self.every == 0 and step != self.last_saved

  def save(self, state: TransitionState) -> None:
    """Saves `state` to this host's local folder (the files in the background).

    Collective: every process must call this, in the same order.

    A failure of the local tier (copying the blocks, the peer exchange,
    writing the files) is logged and recorded (a 'local save failed'
    event; `failed_saves`), never raised: the persistent tier is the record.
    Every process skips the step alike when a process could not contribute
    its blocks to the peer exchange.

    Raises:
      multihost.ConsistencyError: the controllers hold different states.
      multihost.ProcessFailureError, multihost.CollectiveTimeoutError: a
        peer died or stopped in a collective (no tier can save then).
    """
    step, t0 = state.step, time.monotonic()
    raw = state.to_tree()
    tree = leaves.storable(raw)
    digests = consistency.check_consistent(
        tree, what=f'Before the local save of step {step}')
    try:
      self._save(step, tree, _meta.build(state, raw, tree, digests,
                                         reason='local'), t0)
    except (multihost.ProcessFailureError, multihost.CollectiveTimeoutError):
      raise
    except Exception as e:  # pylint: disable=broad-except
      self._failed(step, t0, f'{type(e).__name__}: {_short(e)}')

  def _save(self, step: int, tree, meta: dict, t0: float) -> None:
    """`save` past the consistency check: the blocks, the peer copies, the write started."""
    own: list = []
    sends: list = []
    error: str | None = None
    # The same on every process: all take part in the exchange or none.
    peers_needed = (self.successor is not None
                    and _layout.on_one_host(tree, self.hosts))
    try:
      own, sends = _layout.blocks_to_write(
          tree, self.hosts, self.me, peers=self.successor is not None)
    except Exception as e:  # pylint: disable=broad-except
      error = f'{type(e).__name__}: {_short(e)}'
    peer_blocks = []
    if peers_needed:
      # Every process skips the step if one cannot send its blocks.
      failed = [(p, e) for p, e in
                enumerate(multihost.allgather_object(error)) if e]
      if error is None and failed:
        error = ('the peer copies are incomplete: process(es) '
                 + '; '.join(f'{p}: {e}' for p, e in failed[:4]))
      if not failed:  # Each process's blocks to its successor host alone.
        peer_blocks = self._exchange(sends)
    if error is not None:
      self._failed(step, t0, error)
      return
    manifest = {'directory': self.directory, 'run': self.run,
                'host': self.host,
                'topology': _layout.topology(tree), 'meta': meta,
                'peer_keys': [[k[0], [list(i) for i in k[1]]]
                              for k, _ in peer_blocks]}
    self.wait()
    self._writing = (step, self._pool.submit(self._write, step, manifest,
                                             own + peer_blocks))
    self.last_saved = step
    self.saves += 1
    spent = time.monotonic() - t0
    self.save_seconds += spent
    logging.debug(  # Routine, every few steps: --verbosity=1 shows it.
        '%s Local save of step %d to %s: %d own and %d peer bytes, %d bytes '
        'sent to a peer, %.3f s on the training thread (the files are written '
        'in the background).', _prefix(), step, self.local,
        sum(b.nbytes for _, b in own), sum(b.nbytes for _, b in peer_blocks),
        sum(b.nbytes for _, b in sends), spent)

  def _exchange(self, sends: list) -> list:
    """Sends `sends` to the successor host's lowest process alone (its keeper); returns the blocks sent here (collective; every process sends, an empty list too, so each keeper names its senders)."""
    if self.successor is None:  # (called only where there is one)
      raise CheckpointFolderError(
          f'{_prefix()} Local tier: no successor host to send peer copies '
          'to (the job has one host).')
    keeper = self.lowest[self.successor]
    senders = [p for p, h in enumerate(self.hosts) if self.me == self.lowest[
        self.host] and self._successor_of(h) == self.host]
    got = multihost.exchange({keeper: sends}, recv_from=senders)
    self.peer_bytes_sent += sum(b.nbytes for _, b in sends)
    return [block for p in sorted(got) for block in got[p]]

  def _failed(self, step: int, t0: float, why: str) -> None:
    """Logs and records a local save that failed (never fatal)."""
    self.failed_saves += 1
    _record_event('local save failed', t0, step=step, why=why)
    logging.error('%s The local save of step %d to %s failed (%s); restores '
                  'fall back to older local steps or the persistent tier. '
                  'Training goes on.', _prefix(), step, self.local, why)

  def _successor_of(self, host: str) -> str | None:
    order = self.host_order
    if len(order) < 2:
      return None
    return order[(order.index(host) + 1) % len(order)]

  def _write(self, step: int, manifest: dict, blocks: list) -> None:
    t0 = time.monotonic()
    written = folder.write_step(self.local, self.me, step, manifest, blocks)
    deleted = folder.prune(self.local, self.me, self.run, keep=self.keep,
                           written=step)
    logging.debug('%s Local step %d: %d bytes written to %s in %.3f s; '
                  'deleted steps %s.', _prefix(), step, written, self.local,
                  time.monotonic() - t0, deleted)

  def wait(self) -> None:
    """Waits for the local save in flight; a failed one is logged, not raised.

    The local tier is a faster way back, not the record: a failed local
    write leaves the persistent tier (and older local steps) to restore from.
    """
    writing, self._writing = self._writing, None
    if writing is None:
      return
    step, future = writing
    t0 = time.monotonic()
    try:
      future.result()
    except Exception as e:  # pylint: disable=broad-except
      self.failed_saves += 1
      _record_event('local save failed', t0, step=step,
                    why=f'{type(e).__name__}: {_short(e)}')
      logging.error('%s A local save to %s failed (%s: %s); restores fall '
                    'back to older local steps or the persistent tier. Check '
                    'that the folder is writable and has space.', _prefix(),
                    self.local, type(e).__name__, _short(e))

  def close(self) -> None:
    self.wait()
    self._pool.shutdown(wait=True)

  def set_aside_step(self, step: int) -> str | None:
    """Renames this process's folder of this run's local step `step` aside (`folder.set_aside`); returns its new path, None when there is none or the rename failed (logged).

    A damaged step is kept, never deleted: keep-N and later restores pass
    over the new name.
    """
    try:
      moved = folder.set_aside(self.local, self.me, step, self.run)
    except (OSError, CheckpointFolderError) as e:
      logging.error('%s Local step %d could not be set aside in %s (%s: %s); '
                    'keep-N may delete it.', _prefix(), step, self.local,
                    type(e).__name__, e)
      moved = None
    return moved

  def owns(self, stored: folder.StoredStep) -> bool:
    """Whether a stored local step is this run's (its identity and folder)."""
    return (stored.run == self.run
            and stored.manifest.get('directory') == self.directory)

  def forget(self) -> None:
    """A fresh run: takes a new run identity (deletes nothing).

    Collective: every process must call this, in the same order. With the
    new identity, no step of an earlier run is restored on this run's first
    restart, also one on a host this start does not reach. (`start` refuses
    a fresh start where the hosts hold local steps of the folder:
    `of_folder`.)

    Raises:
      CheckpointFolderError: the new identity cannot be written (on every
        process).
    """
    error = None
    if self.me == 0:
      error = run_identity.write(self.directory, self._fresh_run)
    _raise_agreed(multihost.allgather_object(error),
                  'Starting a fresh local tier')
    self.run = self._fresh_run

  def of_folder(self) -> tuple[dict[int, list[str]], list[int]]:
    """Every committed local step of this checkpoint folder on the hosts, of any run, the same on every process: ({step: its folders}, the steps of this run).

    Collective: every process must call this, in the same order. What a
    fresh start refuses to mix with (`resume.decide`).
    """
    held: dict[int, list[str]] = {}
    own: set[int] = set()
    if self.me == self.lowest[self.host]:  # (The host's folder, once.)
      for s in folder.scan(self.local):
        if s.manifest.get('directory') == self.directory:
          held.setdefault(s.step, []).append(s.folder)
          if self.owns(s):
            own.add(s.step)
    out: dict[int, list[str]] = {}
    mine: set[int] = set()
    for got in multihost.allgather_object((held, own)):
      for step, folders in got[0].items():
        out.setdefault(step, []).extend(folders)
      mine |= got[1]
    return dict(sorted(out.items())), sorted(mine)

  # -- restore ---------------------------------------------------------------

  def newest(self) -> tuple[int | None, list]:
    """The newest step restorable from the local tiers, and what each holds.

    Collective: every process must call this, in the same order. The step
    is the same on every process; None when there is none. (Its topology is
    checked by `restore`.)
    """
    stored = folder.scan(self.local)
    mine: dict[int, dict] = {}
    for s in stored:
      if not self.owns(s):
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
    self.inventory = steps
    usable = sorted((s for s, i in steps.items() if not i['conflict']),
                    reverse=True)
    return (usable[0] if usable else None), usable

  def restore(self, target: TransitionState, *, candidates: list[int],
              not_before: int | None,
              fall_back: bool = True) -> _local_restore.Restored | None:
    """The newest local step in `candidates` (>= `not_before`) that restores.

    Collective: every process must call this, in the same order, after
    `newest`. With `fall_back`, older candidates are tried when a newer one
    fails its checks (`local.restore`); None on every process when none
    restores. The damaged ones are noted in `damaged`, not renamed.

    Raises:
      CheckpointMismatchError: a candidate does not fit `target`.
    """
    got = _local_restore.restore(self, target, candidates=candidates,
                                 not_before=not_before, fall_back=fall_back)
    if got is not None:
      self.restored_bytes_from_peers = got.fetched
      self.last_saved = got.step
    return got
