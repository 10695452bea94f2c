"""A host's local checkpoint folder: one run's per-process step folders, written atomically.

Layout (the same path on every host, on each host's own disk):

  <local>/                               this user's; no one else can write it
  <local>/.recovery-local-disk           the folder's identity
                                         (`private.folder_id`)
  <local>/process_<P>/<step>-<run>/      committed: data.bin, manifest.json,
                                         COMMIT
  <local>/process_<P>/<step>-<run>.tmp-* a write in progress (or killed)

`<run>` is the identity of the run that wrote the step (16 hex digits, kept
in the checkpoint folder: see `tier`), also in the manifest. A run reads,
replaces and deletes only folders of its own identity, so runs that share a
local folder leave each other's steps and writes in progress alone. Each
process writes only its own `process_<P>` subfolder, so several processes
on one host share the folder without locks. A step is written into a
temporary folder, the commit marker last, then renamed into place: a kill
at any point leaves the previous committed steps intact, a failed write
removes its temporary folder, and a reader never takes a folder without its
marker.

Nothing under `<local>` is followed through a symlink. `<local>` and each
`process_<P>` must pass `private.check_private` (created owner-only, mode
0700); entries that are links are skipped when read and refused when
written or deleted, and files are opened with O_NOFOLLOW
(`private.open_file`). Pure file handling: no collective, no JAX call.
"""
from __future__ import annotations

from collections.abc import Iterable
import dataclasses
import errno
import json
import os
import re
import shutil
import stat
import time
from typing import Any

import numpy as np

from multihost.files import fsync_folder
from multihost.files import write_atomic
from recovery._src.local import private
from recovery._src.local import run_identity
from recovery._src.state import leaves
from recovery._src.state.errors import DAMAGED_SUFFIX
from recovery._src.state.errors import CheckpointFolderError

FORMAT = 'recovery-local-v2'
COMMIT = 'COMMIT'
MANIFEST = 'manifest.json'
DATA = 'data.bin'
_PROCESS = 'process_'
# A step's (or a process's) number in a folder name: ASCII digits, written
# as str(int) writes it ('0900' and non-ASCII digits are no step: `number`).
NUMBER = re.compile(r'0|[1-9][0-9]*')
_STEP = re.compile(rf'({NUMBER.pattern})-({private.IDENTITY.pattern})')
_WRITING = re.compile(_STEP.pattern + re.escape(private.TMP) + r'[0-9a-f]+')

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
  run: str  # the identity of the run that wrote it
  folder: str
  manifest: dict[str, Any]
  entries: dict[EntryKey, Entry]


def number(name: str) -> int | None:
  """The step (or process) a folder named `name` holds, or None: a name is one only if it is ASCII digits equal to str(int(name)).

  Anything else ('0900', a person's copy of step 900; digits of another
  script) is foreign: never read, ranked, renamed or deleted as a step.
  """
  return int(name) if NUMBER.fullmatch(name) else None


def process_folder(local: str, process: int) -> str:
  return os.path.join(local, f'{_PROCESS}{process}')


def step_name(step: int, run: str) -> str:
  """The folder name of committed `step` of run `run`: '<step>-<run>'."""
  return f'{step}-{run}'


def prepare(local: str, process: int) -> None:
  """Creates (or checks) `local` and its `process_<process>` subfolder.

  Both are created owner-only (mode 0700); existing ones must pass
  `check_private`. The parents of `local` are created as `os.makedirs` does.

  Raises:
    CheckpointFolderError: a folder cannot be created or fails the check.
  """
  try:
    os.makedirs(os.path.dirname(local), exist_ok=True)
    private.ensure_private(local)
    private.ensure_private(process_folder(local, process))
  except OSError as e:
    raise CheckpointFolderError(
        f'Local checkpoint folder {local} cannot be created ({e.strerror or e}).'
        ' Pick a local folder this user can create and write.') from None


def _own(local: str, process: int) -> str:
  """`process`'s checked subfolder of `local` (created if missing)."""
  private.check_private(local)
  own = process_folder(local, process)
  private.ensure_private(own)
  return own


def _is_dir(path: str) -> bool:
  """Whether `path` is a folder itself (not a link to one)."""
  try:
    return stat.S_ISDIR(os.lstat(path).st_mode)
  except OSError:
    return False


def _remove(path: str) -> bool:
  """Deletes step folder `path` unless it is a link or no folder; whether it did."""
  if not _is_dir(path):
    return False
  # Never follows a link inside (shutil.rmtree.avoids_symlink_attacks).
  shutil.rmtree(path, ignore_errors=True)
  return True


def write_step(local: str, process: int, step: int, manifest: dict[str, Any],
               blocks: Iterable[tuple[EntryKey, np.ndarray]]) -> int:
  """Writes `blocks` as committed step `step` of `process`; returns bytes written.

  The step belongs to run `manifest['run']`. Atomic: a temporary folder
  holds the data, the manifest and the commit marker (last), then is renamed
  to `<step>-<run>`; a failed write removes it. A committed folder of the
  same step of the same run (a restarted run saving a step again) is
  replaced: the new copy takes its name first, and the old copy is removed
  after (`private.replace_folder`), so the step always has a complete copy
  on disk;
  other runs' folders are never touched.

  Raises:
    CheckpointFolderError: `local` or the process subfolder fails
      `check_private`.
    ValueError: `manifest['run']` is not a run identity.
    OSError: the write failed (e.g. the disk is full); nothing is left of it.
  """
  run = manifest.get('run')
  if not run_identity.is_run(run):
    raise ValueError(f'Local step {step} has run identity {run!r} in its '
                     'manifest; a run identity is 16 hex digits (run_identity.new()).')
  own = _own(local, process)
  name = step_name(step, run)
  tmp = os.path.join(own, f'{name}{private.TMP}{private.new_identity()}')
  os.mkdir(tmp, 0o700)
  try:
    listed, offset = [], 0
    with private.open_file(os.path.join(tmp, DATA),
                           os.O_WRONLY | os.O_CREAT | os.O_EXCL) as f:
      for (leaf, index), block in blocks:
        block = np.require(block, requirements='C')  # keeps 0-d as 0-d
        f.write(block.reshape(-1).view(np.uint8).data)
        listed.append({'leaf': leaf, 'index': [list(i) for i in index],
                       'dtype': leaves.dtype_text(block.dtype),
                       'shape': list(block.shape), 'offset': offset,
                       'nbytes': block.nbytes})
        offset += block.nbytes
      f.flush()
      os.fsync(f.fileno())
    write_atomic(os.path.join(tmp, MANIFEST), json.dumps(
        {**manifest, 'format': FORMAT, 'step': step, 'process': process,
         'entries': listed}), mode=0o600)
    write_atomic(os.path.join(tmp, COMMIT), str(step), mode=0o600)
    final = os.path.join(own, name)
    if not os.path.lexists(final):
      os.rename(tmp, final)
    elif not _is_dir(final):
      raise OSError(errno.EEXIST, f'{final} exists and is not a folder (a '
                    f'symlink or a file), so local step {step} cannot take '
                    'its place; remove it by hand.')
    else:
      private.replace_folder(tmp, final)  # The old copy now at tmp.
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)  # Or the old copy, once replaced.
    raise
  fsync_folder(own)
  shutil.rmtree(tmp, ignore_errors=True)  # The old copy, if it replaced one.
  return offset


def _real_file(path: str) -> os.stat_result | None:
  try:
    st = os.lstat(path)
  except OSError:
    return None
  return st if stat.S_ISREG(st.st_mode) else None


def _read(path: str, step: int, run: str, process: int) -> StoredStep | None:
  """The committed step in folder `path` (named `<step>-<run>`), or None."""
  if not _is_dir(path):
    return None  # a link, or no folder
  data = os.path.join(path, DATA)
  info = _real_file(data)
  if _real_file(os.path.join(path, COMMIT)) is None or info is None:
    return None
  try:
    with private.open_file(os.path.join(path, MANIFEST), os.O_RDONLY) as f:
      manifest = json.load(f)
  except (OSError, ValueError):
    return None
  if (not isinstance(manifest, dict) or manifest.get('format') != FORMAT
      or not isinstance(manifest.get('meta'), dict)
      or 'digest' not in manifest['meta']
      # The folder's name, the manifest and the subfolder agree.
      or manifest.get('run') != run or manifest.get('step') != step
      or manifest.get('process') != process):
    return None
  try:
    entries = {}
    for e in manifest['entries']:
      key = (e['leaf'], tuple((int(a), int(b)) for a, b in e['index']))
      entry = Entry(key=key, dtype=e['dtype'], shape=tuple(e['shape']),
                    offset=int(e['offset']), nbytes=int(e['nbytes']),
                    path=data)
      if entry.offset + entry.nbytes > info.st_size:
        return None  # truncated: not a usable step
      entries[key] = entry
  except (KeyError, TypeError, ValueError):
    return None
  return StoredStep(step=step, run=run, folder=path, manifest=manifest,
                    entries=entries)


def scan(local: str) -> list[StoredStep]:
  """Every committed step of every run in every process subfolder of `local`.

  Entries that are links, and subfolders that fail `check_private`, are
  skipped; so is all of `local` when it fails it (the tier refuses such a
  folder when it starts).
  """
  out: list[StoredStep] = []
  try:
    private.check_private(local)
    names = sorted(os.listdir(local))
  except (CheckpointFolderError, OSError):
    return out
  for name in names:
    index = number(name[len(_PROCESS):])
    if not name.startswith(_PROCESS) or index is None:
      continue
    sub = os.path.join(local, name)
    try:
      private.check_private(sub)
      step_names = os.listdir(sub)
    except (CheckpointFolderError, OSError):
      continue
    for step_name_ in sorted(step_names):
      m = _STEP.fullmatch(step_name_)
      if m:
        stored = _read(os.path.join(sub, step_name_), int(m.group(1)),
                       m.group(2), index)
        if stored is not None:
          out.append(stored)
  return out


def read_block(entry: Entry) -> np.ndarray:
  """The block's array, read from its data file (never through a link)."""
  out = np.empty(entry.shape, leaves.dtype_of(entry.dtype))
  with private.open_file(entry.path, os.O_RDONLY) as f:
    f.seek(entry.offset)
    view = out.reshape(-1).view(np.uint8).data
    if f.readinto(view) != entry.nbytes:
      raise OSError(f'{entry.path} ends before block {entry.key[0]} '
                    f'{list(entry.key[1])} (offset {entry.offset}, '
                    f'{entry.nbytes} bytes).')
  return out


def _names(local: str, process: int) -> tuple[str, list[str]]:
  own = process_folder(local, process)
  private.check_private(local)
  private.check_private(own)
  return own, os.listdir(own)


def prune(local: str, process: int, run: str, *, keep: int,
          written: int) -> list[int]:
  """Keeps step `written` of run `run` and its `keep` - 1 newest older steps.

  Only `process`'s steps of `run` are ranked and deleted; other runs' are
  never touched. Steps of `run` newer than `written` are deleted: the run
  has gone back to an older step (they failed their checks at the restore,
  or a persistent step was newer), so a later restart must not return to
  them. This run's temporary folders are removed too: `written` was the
  process's one write in flight. Returns the steps deleted.

  Raises:
    CheckpointFolderError: `local` or the process subfolder fails
      `check_private`.
  """
  own, names = _names(local, process)
  mine = {}
  for name in names:
    m = _STEP.fullmatch(name)
    if m and m.group(2) == run and _is_dir(os.path.join(own, name)):
      mine[int(m.group(1))] = name
  _remove_writing(own, names, run)
  older = sorted(s for s in mine if s < written)
  deleted = sorted([*older[:max(0, len(older) - (keep - 1))],
                    *(s for s in mine if s > written)])
  return [s for s in deleted if _remove(os.path.join(own, mine[s]))]


def set_aside(local: str, process: int, step: int, run: str) -> str | None:
  """Renames `process`'s folder of step `step` of run `run` to `<step>-<run>.damaged-<UTC time>`; returns the new path, or None when it has no such folder.

  The new name matches no step pattern: `scan`, `prune` and `remove_tmp`
  never read, rank or delete it (a person may, to see what went wrong).

  Raises:
    CheckpointFolderError: `local` or the process subfolder fails
      `check_private`.
    OSError: the rename failed.
  """
  own = _own(local, process)
  name = step_name(step, run)
  if not _is_dir(os.path.join(own, name)):
    return None
  path = aside_path(own, name)
  os.rename(os.path.join(own, name), path)
  fsync_folder(own)
  return path


def aside_path(directory: str, name: str) -> str:
  """A free path `<directory>/<name>.damaged-<UTC time>[-N]` for a damaged step set aside (persistent or local)."""
  stamp = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())
  base = os.path.join(directory, f'{name}{DAMAGED_SUFFIX}{stamp}')
  path, n = base, 1
  while os.path.lexists(path):  # The same step set aside twice this second.
    n += 1
    path = f'{base}-{n}'
  return path


def remove_tmp(local: str, process: int, run: str) -> None:
  """Removes `process`'s temporary folders of run `run` (its writes killed mid-way).

  Never another run's: it may be writing now.
  """
  try:
    own, names = _names(local, process)
  except (CheckpointFolderError, OSError):
    return
  _remove_writing(own, names, run)


def _remove_writing(own: str, names: Iterable[str], run: str) -> None:
  """Removes, of `names` in the process subfolder `own`, run `run`'s steps in writing (`<step>-<run>.tmp-*`).

  A committed one (its marker written) whose step has no folder (a
  replacement killed between its renames, `private.replace_folder`) takes
  that place instead: a complete copy of the step is never removed.
  """
  for name in sorted(names):
    m = _WRITING.fullmatch(name)
    if m and m.group(2) == run:
      path, final = (os.path.join(own, name),
                     os.path.join(own, name[:m.end(2)]))
      if (not os.path.lexists(final) and _is_dir(path) and
          _real_file(os.path.join(path, COMMIT)) is not None):
        os.rename(path, final)
        continue
      _remove(path)
