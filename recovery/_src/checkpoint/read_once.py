"""A persistent restore that reads each replicated byte from storage once per job.

A leaf that every process holds whole (a NumPy leaf, or a jax.Array whose
shards on each process cover all of it: replicated across processes) would
otherwise be read in full by every process. Here each such leaf is read by
one process (its reader) and reaches the others over multihost's data plane:

1. `plan`: leaves under `SMALL_BYTES` go to process 0; larger ones, largest
   first, to the process with the fewest bytes so far (the lowest index on
   a tie). Every process computes the same plan from the same target.
2. `read`: every process calls Orbax's restore (on a `Checkpointer` of its
   own, which meets no other process) with a target that holds only its own leaves to read
   whole (as NumPy) and the leaves that are split across processes (onto
   their shardings, each process reading its own shards, as before); the
   others' leaves are `ocp.PLACEHOLDER`s, which Orbax skips.
3. `share`, after every process agreed that its read succeeded (so no
   process is still reading): one `multihost.broadcast_one_to_all` per
   reader with leaves, its leaves' bytes as uint8 (bit for bit, -0.0 and
   NaN payloads kept); then each process places every leaf as the target
   asks (a NumPy array, or its own shards of the jax.Array, built on the
   host with `jax.make_array_from_callback`: no compiled collective).

Storage bytes read per job: the state once (plus each process's read of
the step's small metadata files). Bytes in per process: every replicated
leaf once (it needs them all); out of a reader: its leaves' bytes times the
data plane's fan-out (a tree or chain: a few copies, not P).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

import multihost

# Leaves smaller than this are all read by process 0 (one broadcast), so a
# state's many small leaves do not each cost a call.
SMALL_BYTES = 1 << 20

PyTree = Any


def _part_of(whole: np.ndarray, index: Any) -> np.ndarray:
  """The part of `whole` at `index` (a device's, for `make_array_from_callback`)."""
  return whole[index]


def _nbytes(x: Any) -> int:
  return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def bytes_read() -> int | None:
  """The bytes this process has read so far by read calls (/proc/self/io `rchar`), or None where there is no such count.

  It counts page-cache hits too: bytes asked of storage, not only those
  that came from a disk. Sockets read with `read`/`readv` count as well,
  so it measures storage only over a span that moves no data over them.
  """
  try:
    with open('/proc/self/io', 'rb') as f:
      for line in f:
        if line.startswith(b'rchar:'):
          return int(line.split()[1])
  except OSError:
    pass
  return None


def whole_on_every_process(x: Any) -> bool:
  """Whether every process restores all of target leaf `x` (NumPy, or a jax.Array replicated across processes).

  A jax.Array target (`jax.ShapeDtypeStruct` with a sharding) is whole on
  a process when its shards there cover every element: distinct shards of
  a sharding are disjoint, so their sizes add up to the array's.
  """
  if not isinstance(x, jax.ShapeDtypeStruct) or x.sharding is None:
    return True
  if x.sharding.is_fully_replicated:
    return True
  held: dict[int, set] = {}
  for device, index in x.sharding.devices_indices_map(x.shape).items():
    held.setdefault(device.process_index, set()).add(
        tuple((s.start, s.stop) for s in index))
  total = math.prod(x.shape)
  for process in range(jax.process_count()):
    size = 0
    for index in held.get(process, ()):
      size += math.prod(
          (hi if hi is not None else n) - (lo or 0)
          for (lo, hi), n in zip(index, x.shape, strict=True))
    if size != total:
      return False
  return True


def plan(abstract: PyTree, processes: int) -> dict[tuple, int]:
  """{leaf key path: its reader} for the leaves of `abstract` that every process holds whole.

  The same on every process for the same target: small leaves are
  process 0's; larger ones, largest first, the least-loaded process's.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(abstract)
  whole = [(path, x) for path, x in flat if whole_on_every_process(x)]
  load = [0] * processes
  readers: dict[tuple, int] = {}
  for path, x in whole:
    if _nbytes(x) < SMALL_BYTES:
      readers[path] = 0
      load[0] += _nbytes(x)
  big = sorted((p for p in whole if p[0] not in readers),
               key=lambda p: -_nbytes(p[1]))
  for path, x in big:
    reader = min(range(processes), key=lambda p: (load[p], p))
    readers[path] = reader
    load[reader] += _nbytes(x)
  return readers


def read(directory: str, step: int, abstract: PyTree,
         readers: dict[tuple, int],
         checkpointer: ocp.Checkpointer) -> PyTree:
  """This process's part of restoring step `step`'s `state` item.

  Not a collective: `checkpointer` (`manager.reader`) meets no other
  process, so a process whose read fails raises at once and the others
  meet it at the caller's next agreement. Returns `abstract`'s tree: this process's
  leaves to read whole as NumPy arrays, the split leaves as Orbax restores
  them, and `ocp.PLACEHOLDER` for every leaf another process reads.
  """
  me = jax.process_index()
  default = ocp.checkpoint_utils.construct_restore_args(abstract)

  def item(path, x):
    reader = readers.get(path)
    if reader is None:
      return x
    return (np.zeros(x.shape, x.dtype) if reader == me
            else ocp.PLACEHOLDER)

  def arg(path, x, default_arg):
    reader = readers.get(path)
    if reader is None:
      return default_arg
    return (ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.dtype(x.dtype))
            if reader == me else ocp.PLACEHOLDER)

  target = jax.tree_util.tree_map_with_path(item, abstract)
  args = jax.tree_util.tree_map_with_path(arg, abstract, default)
  return checkpointer.restore(
      os.path.join(directory, str(step), 'state'),
      args=ocp.args.PyTreeRestore(target, restore_args=args))


def share(restored: PyTree, abstract: PyTree, readers: dict[tuple, int], *,
          timeout: float | None = None) -> PyTree:
  """`restored` (from `read`) with every leaf whole on every process, placed as `abstract` asks.

  Collective: every process must call this, in the same order, after every
  process's `read` has returned (one broadcast per reader with leaves,
  over multihost's data plane).
  """
  me = jax.process_index()
  flat_abstract, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  # jax's `PyTreeDef` (jaxlib's) does not resolve for mypy (it reports an
  # unresolved `PyTreeDef?`); the method exists on every treedef.
  flat = treedef.flatten_up_to(restored)  # type: ignore[attr-defined]
  got: dict[tuple, np.ndarray] = {}
  for reader in sorted(set(readers.values())):
    paths = [path for path, _ in flat_abstract if readers.get(path) == reader]
    sizes = {path: _nbytes(x) for path, x in flat_abstract if path in paths}
    if reader == me:
      by_path = dict(zip([p for p, _ in flat_abstract], flat, strict=True))
      mine = [np.ascontiguousarray(by_path[p]).reshape(-1).view(np.uint8)
              for p in paths]
    else:
      mine = [np.zeros(sizes[p], np.uint8) for p in paths]
    received = multihost.broadcast_one_to_all(mine, is_source=reader == me,
                                              timeout=timeout)
    got.update(zip(paths, received, strict=True))
  out = []
  for (path, x), value in zip(flat_abstract, flat, strict=True):
    if path not in readers:
      out.append(value)
      continue
    whole = got[path].view(np.dtype(x.dtype)).reshape(x.shape)
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
      out.append(jax.make_array_from_callback(
          x.shape, x.sharding, functools.partial(_part_of, whole)))
    else:
      out.append(whole)
  return jax.tree_util.tree_unflatten(treedef, out)
