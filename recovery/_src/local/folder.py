"""A host's local checkpoint folder: per-process step folders, written atomically.

Layout (the same path on every host, on each host's own disk):

  <local>/process_<P>/<step>/        committed: data.bin, manifest.json, COMMIT
  <local>/process_<P>/<step>.tmp-*   a write in progress (or killed mid-way)

Each process writes only its own `process_<P>` subfolder, so several
processes on one host share the folder without locks. A step is written into
a temporary folder, the commit marker last, then renamed into place: a kill
at any point leaves the previous committed steps intact, and a reader never
takes a folder without its marker. Pure file handling: no collective, no JAX.
"""

from __future__ import annotations

from collections.abc import Iterable
import dataclasses
import json
import os
import secrets
import shutil
from typing import Any

import numpy as np

FORMAT = 'recovery-local-v1'
COMMIT = 'COMMIT'
MANIFEST = 'manifest.json'
DATA = 'data.bin'
_PROCESS = 'process_'
_TMP = '.tmp-'

# (leaf path, index) names one entry: a leaf's block, its index a tuple of
# (start, stop) per dimension ( () for a whole 0-d or host-held leaf).
EntryKey = tuple[str, tuple[tuple[int, int], ...]]


@dataclasses.dataclass(frozen=True)
class Entry:
  """One stored block: where its bytes are, and what they are."""
  key: EntryKey
  dtype: str
  shape: tuple[int, ...]
  offset: int
  nbytes: int
  path: str  # the step folder's data file


@dataclasses.dataclass(frozen=True)
class StoredStep:
  """A committed step in some process's subfolder of this host's folder."""
  step: int
  folder: str
  manifest: dict[str, Any]
  entries: dict[EntryKey, Entry]


def process_folder(local: str, process: int) -> str:
  return os.path.join(local, f'{_PROCESS}{process}')


def write_step(local: str, process: int, step: int, manifest: dict[str, Any],
               blocks: Iterable[tuple[EntryKey, np.ndarray]]) -> int:
  """Writes `blocks` as committed step `step` of `process`; returns bytes written.

  Atomic: a temporary folder holds the data, the manifest and the commit
  marker (last), then is renamed to `<step>`. A stale committed folder of
  the same step (an earlier run's) is replaced.
  """
  own = process_folder(local, process)
  os.makedirs(own, exist_ok=True)
  tmp = os.path.join(own, f'{step}{_TMP}{secrets.token_hex(4)}')
  os.mkdir(tmp)
  listed, offset = [], 0
  with open(os.path.join(tmp, DATA), 'wb') as f:
    for (leaf, index), block in blocks:
      block = np.require(block, requirements='C')  # keeps 0-d as 0-d
      f.write(memoryview(block.reshape(-1).view(np.uint8)))
      listed.append({'leaf': leaf, 'index': [list(i) for i in index],
                     'dtype': block.dtype.str, 'shape': list(block.shape),
                     'offset': offset, 'nbytes': block.nbytes})
      offset += block.nbytes
  with open(os.path.join(tmp, MANIFEST), 'w') as f:
    json.dump({**manifest, 'format': FORMAT, 'step': step,
               'process': process, 'entries': listed}, f)
  with open(os.path.join(tmp, COMMIT), 'w') as f:
    f.write(str(step))
  final = os.path.join(own, str(step))
  if os.path.lexists(final):
    shutil.rmtree(final, ignore_errors=True)
  os.rename(tmp, final)
  return offset


def _read(folder: str) -> StoredStep | None:
  if not os.path.isfile(os.path.join(folder, COMMIT)):
    return None
  try:
    with open(os.path.join(folder, MANIFEST)) as f:
      manifest = json.load(f)
  except (OSError, ValueError):
    return None
  if (not isinstance(manifest, dict) or manifest.get('format') != FORMAT
      or not isinstance(manifest.get('meta'), dict)
      or 'digest' not in manifest['meta']):
    return None
  data = os.path.join(folder, DATA)
  try:
    size = os.path.getsize(data)
    entries = {}
    for e in manifest['entries']:
      key = (e['leaf'], tuple(tuple(int(v) for v in i) for i in e['index']))
      entry = Entry(key=key, dtype=e['dtype'], shape=tuple(e['shape']),
                    offset=int(e['offset']), nbytes=int(e['nbytes']),
                    path=data)
      if entry.offset + entry.nbytes > size:
        return None  # truncated: not a usable step
      entries[key] = entry
  except (OSError, KeyError, TypeError, ValueError):
    return None
  return StoredStep(step=int(manifest['step']), folder=folder,
                    manifest=manifest, entries=entries)


def scan(local: str) -> list[StoredStep]:
  """Every committed step of every process subfolder of this host's folder."""
  out = []
  try:
    names = sorted(os.listdir(local))
  except FileNotFoundError:
    return out
  for name in names:
    sub = os.path.join(local, name)
    if not name.startswith(_PROCESS) or not os.path.isdir(sub):
      continue
    for step_name in os.listdir(sub):
      if step_name.isdigit():
        stored = _read(os.path.join(sub, step_name))
        if stored is not None:
          out.append(stored)
  return out


def read_block(entry: Entry) -> np.ndarray:
  """The block's array, read from its data file."""
  out = np.empty(entry.shape, np.dtype(entry.dtype))
  with open(entry.path, 'rb') as f:
    f.seek(entry.offset)
    view = memoryview(out.reshape(-1).view(np.uint8))
    if f.readinto(view) != entry.nbytes:
      raise OSError(f'{entry.path} ends before block {entry.key[0]} '
                    f'{list(entry.key[1])} (offset {entry.offset}, '
                    f'{entry.nbytes} bytes).')
  return out


def prune(local: str, process: int, keep: int) -> list[int]:
  """Keeps the newest `keep` committed steps of `process`; removes leftovers.

  Returns the steps deleted. Temporary folders of this process's interrupted
  writes are removed too (only this process writes its subfolder).
  """
  own = process_folder(local, process)
  try:
    names = os.listdir(own)
  except FileNotFoundError:
    return []
  steps = sorted(int(n) for n in names if n.isdigit())
  deleted = steps[:-keep] if keep else steps
  for step in deleted:
    shutil.rmtree(os.path.join(own, str(step)), ignore_errors=True)
  return deleted


def remove_tmp(local: str, process: int) -> None:
  """Removes this process's temporary folders (writes killed mid-way)."""
  own = process_folder(local, process)
  try:
    names = os.listdir(own)
  except FileNotFoundError:
    return
  for n in names:
    if _TMP in n:
      shutil.rmtree(os.path.join(own, n), ignore_errors=True)


def remove_steps(stored: Iterable[StoredStep]) -> None:
  """Deletes the given committed steps (a fresh run's stale ones)."""
  for s in stored:
    shutil.rmtree(s.folder, ignore_errors=True)
