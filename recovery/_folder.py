"""What is in a checkpoint folder: this project's steps, foreign entries, leftovers of crashed saves.

A step folder is this project's when its `meta/metadata` JSON names the
checkpoint format. Anything else with a step-like (all-digit) name is
foreign: never read as a step, never deleted, and named in a warning.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

from absl import logging
import jax

_TMP = re.compile(r'\d+\.orbax-checkpoint-tmp.*')


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
  """Whether `<directory>/<step>` is a committed step of one of `formats`.

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


def scan(directory: str, formats: tuple[str, ...]) -> tuple[list[int], list[str]]:
  """(this project's committed steps, foreign step-like entries) in `directory`."""
  ours, foreign = [], []
  try:
    names = os.listdir(directory)
  except OSError:
    return [], []
  for name in names:
    if name.isdigit():
      (ours.append(int(name)) if is_ours(directory, name, formats)
       else foreign.append(name))
  return sorted(ours), sorted(foreign)


def prepare(directory: str, formats: tuple[str, ...], *, writable: bool) -> None:
  """At start: warns about foreign entries; removes leftovers of crashed saves (process 0, with the lock held)."""
  _, foreign = scan(directory, formats)
  if foreign:
    logging.warning(
        '%s holds %s, which %s not checkpoints of this project (no %s '
        'meta item): left untouched and ignored.', directory, foreign,
        'is' if len(foreign) == 1 else 'are', ' or '.join(formats))
  if not writable or jax.process_index() != 0:
    return
  for name in sorted(os.listdir(directory)):
    if _TMP.fullmatch(name):
      logging.warning('Removing %s, left in %s by a save that did not '
                      'commit.', name, directory)
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
