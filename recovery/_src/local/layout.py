"""Where a state's blocks live: hosts, block keys, the topology digest, assembly.

A block is one leaf's piece as a device holds it, named by (leaf path, index
key); a host-held or unplaced leaf is one block with the index key (). These
facts come from the global shardings alone, so every process computes the
same ones without a collective.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
from typing import Any

from absl import logging
import jax
import numpy as np

from multihost import env as _env
from multihost import process_prefix as _prefix
from recovery._src.local.folder import EntryKey
from recovery._src.state import digest
from recovery._src.state.errors import CheckpointError

# Overrides the local folder's identity (`private.folder_id`) that tells
# the local tier's hosts apart: processes with the same value are taken to
# share one local folder.
HOST_ID_VARIABLE = _env.RECOVERY_HOST_ID


def host_override() -> str | None:
  """$RECOVERY_HOST_ID if set (and not blank), else None."""
  return os.environ.get(HOST_ID_VARIABLE, '').strip() or None


def host_id(local_folder_id: str) -> str:
  """This process's host for the local tier: $RECOVERY_HOST_ID, else its local folder's identity.

  A "host" is the set of processes that share one local folder: they read
  the same identity from it (`private.folder_id`), whatever their hostnames,
  and processes with a folder each (a disk each at the same path, even under
  one hostname) read different ones.
  """
  override = host_override()
  return override if override is not None else f'folder-{local_folder_id}'


def hostname() -> str:
  """This machine's hostname (for messages only: it never tells hosts apart)."""
  return socket.gethostname()


def index_key(index: tuple, shape: tuple[int, ...]) -> tuple:
  """A device index (slices) as ((start, stop), ...), one pair per dimension."""
  return tuple((s.indices(n)[0], s.indices(n)[1])
               for s, n in zip(index, shape, strict=True))


@functools.lru_cache(maxsize=256)
def array_layout(sharding: jax.sharding.Sharding,
                 shape: tuple[int, ...]) -> tuple[dict, tuple]:
  """({index key: processes holding it}, (device id, process, key) sorted)."""
  holders: dict[tuple, set[int]] = {}
  placed = []
  for device, index in sharding.devices_indices_map(shape).items():
    key = index_key(index, shape)
    # jax's `Device` (jaxlib's) does not resolve for mypy (it reports an
    # unresolved `Device?`); the attributes exist on every device.
    process = device.process_index  # type: ignore[attr-defined]
    holders.setdefault(key, set()).add(process)
    placed.append((device.id, process, key))  # type: ignore[attr-defined]
  return ({k: frozenset(v) for k, v in holders.items()}, tuple(sorted(placed)))


def is_placed(x: Any) -> bool:
  """Whether a storable (or abstract) leaf is a global array on a sharding."""
  return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and getattr(
      x, 'sharding', None) is not None


def named_leaves(tree) -> list[tuple[str, Any]]:
  return [(digest.path_name(p), x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def on_one_host(tree, hosts: list[str]) -> bool:
  """Whether some block of `tree` is held on one host only (`hosts`: each process's), so that it needs a peer copy."""
  return any(len({hosts[p] for p in where}) == 1
             for _, x in named_leaves(tree) if is_placed(x)
             for where in array_layout(x.sharding, tuple(x.shape))[0].values())


def blocks_to_write(tree, hosts: list[str], me: int, *,
                    peers: bool) -> tuple[list, list]:
  """(the blocks process `me` writes, those of them it sends to a peer where `peers`), copied to host memory.

  A block is written by the lowest process of its host that holds it; one
  held on one host only is sent to the peer. The copies are made on this
  thread: the caller may update its arrays in place (or donate their
  buffers) as soon as this returns, while the files are still written.
  """
  own, sends = [], []
  for name, x in named_leaves(tree):
    if is_placed(x):
      holders, _ = array_layout(x.sharding, tuple(x.shape))
      mine: dict[Any, Any] = {}
      for shard in x.addressable_shards:
        mine.setdefault(index_key(shard.index, tuple(x.shape)), shard.data)
    else:
      holders = {(): frozenset(range(len(hosts)))}
      mine = {(): x}
    for key, where in holders.items():
      if key not in mine or me != min(p for p in where
                                      if hosts[p] == hosts[me]):
        continue
      block = np.array(np.asarray(mine[key]), copy=True)
      own.append(((name, key), block))
      if peers and len({hosts[p] for p in where}) == 1:
        sends.append(((name, key), block))
  return own, sends


def warn_if_overridden_apart(gathered: list[dict]) -> None:
  """Warns where $RECOVERY_HOST_ID puts processes with different local folders on one host (`gathered`: each process's host and folder)."""
  folders: dict[str, dict[str, list[int]]] = {}
  for p, g in enumerate(gathered):
    folders.setdefault(g['host'], {}).setdefault(g['folder'], []).append(p)
  for host, seen in folders.items():
    if len(seen) > 1:
      logging.warning(
          '%s $%s=%s is set on processes %s, but they see %d different '
          'local folders (%s): the local tier takes them as one host, so '
          'blocks written once per host may be on a disk the others cannot '
          'read, and a restore from the local tier may fall back to the '
          'persistent tier. Unset $%s: processes that share a local folder '
          'find each other through it.', _prefix(), HOST_ID_VARIABLE, host,
          sorted(p for ps in seen.values() for p in ps), len(seen),
          '; '.join(f'processes {ps}: {f}' for f, ps in seen.items()),
          HOST_ID_VARIABLE)


def topology(tree) -> str:
  """A digest of where each placed leaf's blocks live (devices, processes).

  Equal for a saving run and a restoring run on the same topology and
  shardings; an elastic restore (other processes, devices or shardings)
  differs, and takes the persistent tier.
  """
  h = hashlib.sha256(f'{jax.process_count()}/{jax.device_count()}'.encode())
  for name, x in named_leaves(tree):
    if is_placed(x):
      h.update(repr((name, tuple(x.shape),
                     array_layout(x.sharding, tuple(x.shape))[1])).encode())
  return h.hexdigest()


def needed(tree, process: int) -> set[EntryKey]:
  """The blocks `process` needs to rebuild its part of `tree`."""
  out = set()
  for name, x in named_leaves(tree):
    if is_placed(x):
      for _, p, key in array_layout(x.sharding, tuple(x.shape))[1]:
        if p == process:
          out.add((name, key))
    else:
      out.add((name, ()))
  return out


def assemble(abstract, blocks: dict[EntryKey, np.ndarray], *,
             where: str = 'A local step'):
  """The storable tree, each placed leaf built from this process's blocks.

  Raises:
    CheckpointError: a block this process needs is missing from `blocks`
      (the message names it and `where`).
    TypeError: a block's dtype differs from the target leaf's.
  """

  def get(key: EntryKey) -> np.ndarray:
    if key not in blocks:
      raise CheckpointError(
          f'{where}: block {key[0]} {list(key[1])} is missing on process '
          f'{jax.process_index()}; the step cannot be assembled here.')
    return blocks[key]

  def leaf(path, x):
    name = digest.path_name(path)
    if is_placed(x):
      shape = tuple(x.shape)
      arrays = []
      for device, index in x.sharding.addressable_devices_indices_map(
          shape).items():
        block = get((name, index_key(index, shape)))
        if block.dtype != np.dtype(x.dtype):
          raise TypeError(f'block of {name} has dtype {block.dtype}, the '
                          f'target {np.dtype(x.dtype)}')
        arrays.append(jax.device_put(block, device))
      return jax.make_array_from_single_device_arrays(shape, x.sharding,
                                                      arrays)
    return np.asarray(get((name, ())))

  return jax.tree_util.tree_map_with_path(leaf, abstract)
