"""What is in a checkpoint folder: this project's steps, foreign entries, leftovers of crashed saves.

A folder name is a step only if it is ASCII digits equal to str(int(name))
(`local.folder.number`: '900', not '0900'). A step folder is this project's
when it is a real folder directly inside the checkpoint folder and its
`meta/metadata` JSON names the checkpoint format. A symlink whose target is
such a step (a warm start by link) is *linked*: read for a resume, never
deleted or written through. Anything else with a step-like (all-digit, in
any script) name is foreign: never read as a step, never deleted.
Both are named in a warning. Nothing is deleted unless its real path lies
directly inside the real checkpoint folder (`inside`). A damaged step set
aside by a resume (`set_aside`: `<step>.damaged-<UTC time>`) is not step-like:
ignored by the scan and by Orbax, never deleted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from typing import Any

from absl import logging
import jax

from multihost import process_prefix as _prefix
from recovery._src.local import folder as local_folder
from recovery._src.state.errors import CheckpointFolderError

TMP_SUFFIX = '.orbax-checkpoint-tmp'
_TMP = re.compile(f'({local_folder.NUMBER.pattern})' + re.escape(TMP_SUFFIX)
                  + '.*')


@dataclasses.dataclass(frozen=True)
class Listing:
  """A checkpoint folder's step-like entries, each list sorted.

  Attributes:
    ours: this project's committed steps, real folders inside the folder:
      the only ones keep-N may delete.
    linked: committed steps of this project reached through a symlink:
      readable, never deleted or written through.
    foreign: other all-digit entries ('0900' among them), ignored.
  """
  ours: tuple[int, ...] = ()
  linked: tuple[int, ...] = ()
  foreign: tuple[str, ...] = ()


def meta_path(directory: str, step: int | str) -> str:
  """Where Orbax's JSON handler keeps a step's `meta` item."""
  return os.path.join(directory, str(step), 'meta', 'metadata')


def read_meta(directory: str, step: int | str) -> Any:
  """The parsed `meta` item of `<directory>/<step>`.

  Read straight from the file, as `is_ours` does, rather than through an
  Orbax restore (which meets the other processes at a barrier).

  Raises:
    OSError: no readable meta item.
    ValueError: it is not JSON.
  """
  with open(meta_path(directory, step)) as f:
    return json.loads(f.read())


def is_ours(directory: str, step: int | str, formats: tuple[str, ...]) -> bool:
  """Whether `<directory>/<step>` (or its link's target) is a committed step of one of `formats`.

  A step whose meta item exists but cannot be parsed counts as ours (a
  damaged checkpoint, reported as such when read), not as foreign.
  """
  try:
    meta = read_meta(directory, step)
  except OSError:
    return False
  except ValueError:
    return True
  return isinstance(meta, dict) and meta.get('format') in formats


def inside(directory: str, name: str) -> bool:
  """Whether `<directory>/<name>` is no symlink and really lies directly inside `directory`."""
  path = os.path.join(directory, name)
  if os.path.islink(path):
    return False
  real = os.path.realpath(path)
  return (os.path.dirname(real) == os.path.realpath(directory)
          and os.path.basename(real) == name)


def scan(directory: str, formats: tuple[str, ...]) -> Listing:
  """The step-like entries of `directory`, sorted into a `Listing`."""
  ours, linked, foreign = [], [], []
  try:
    names = os.listdir(directory)
  except OSError:
    return Listing()
  for name in names:
    if name.isdigit() and local_folder.number(name) is None:
      foreign.append(name)  # step-like, but no step ('0900')
      continue
    step = local_folder.number(name)
    if step is None:
      continue
    if not is_ours(directory, name, formats):
      foreign.append(name)
    elif inside(directory, name):
      ours.append(step)
    else:
      linked.append(step)
  return Listing(tuple(sorted(ours)), tuple(sorted(linked)),
                 tuple(sorted(foreign)))


def set_aside(directory: str, step: int) -> str:
  """Renames step folder `<directory>/<step>` to `<step>.damaged-<UTC time>` beside it; returns the new path.

  Only process 0 calls this, with the folder's lock held. The new name is
  not step-like, so neither this project nor Orbax reads it as a step, and
  keep-N never deletes it. A symlinked step is renamed as a link: its
  target is untouched.

  Raises:
    OSError: the rename failed.
  """
  path = local_folder.aside_path(directory, str(step))
  os.rename(os.path.join(directory, str(step)), path)
  return path


def partial_steps(directory: str) -> list[int]:
  """Steps of saves that started and never committed (`<step>.orbax-checkpoint-tmp*`)."""
  try:
    names = os.listdir(directory)
  except OSError:
    return []
  return sorted(int(m.group(1)) for m in map(_TMP.fullmatch, names) if m)


def ensure_writable(directory: str) -> None:
  """Creates `directory` if needed and checks that this process can write it.

  Raises:
    CheckpointFolderError: it cannot be created or written.
  """
  probe = os.path.join(
      directory, f'.write-probe-{jax.process_index()}-{os.getpid()}')
  try:
    os.makedirs(directory, exist_ok=True)
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                 0o600)
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise CheckpointFolderError(
        f'{_prefix()} Checkpoint folder {directory} is not writable '
        f'({type(e).__name__}: {e.strerror or e}). Pick a folder this user can '
        'write, shared by every process.') from e


def prepare(directory: str, listing: Listing, *, writable: bool) -> None:
  """At start: names linked and foreign entries; removes leftovers of crashed saves (process 0, with the lock held)."""
  if listing.linked:
    logging.warning(
        '%s holds %s, symlinked to checkpoints outside it: read for a resume, '
        'never deleted or written through (keep-N leaves them alone).',
        directory, [os.path.join(directory, str(s)) + ' -> ' +
                    os.path.realpath(os.path.join(directory, str(s)))
                    for s in listing.linked])
  if listing.foreign:
    logging.warning(
        '%s holds %s, which %s not checkpoints of this project (no meta '
        'item of this format): left untouched and ignored.', directory,
        list(listing.foreign), 'is' if len(listing.foreign) == 1 else 'are')
  if not writable or jax.process_index() != 0:
    return
  for name in sorted(os.listdir(directory)):
    if not _TMP.fullmatch(name):
      continue
    if not inside(directory, name):
      logging.warning('Not removing %s in %s, left by a save that did not '
                      'commit: it is a symlink or lies outside the folder.',
                      name, directory)
      continue
    logging.warning('Removing %s, left in %s by a save that did not '
                    'commit.', name, directory)
    shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
