"""Every error `recovery` raises, and the advice its messages end with.

The advice ("what to do now") is written here once, so the checkpoint
folder, the loop and the binaries tell the user the same thing.
"""

from __future__ import annotations

import os

# How to continue after a stop (preemption, Ctrl-C, a failure): a sentence.
RELAUNCH_WITH_RESUME = 'Relaunch with --resume to continue.'
# How to begin again when a folder cannot be used.
START_FRESH = 'start fresh in a new folder'


class CheckpointError(RuntimeError):
  """A checkpoint is missing, unreadable, partial, or does not fit this run."""


class CheckpointCorruptError(CheckpointError):
  """A checkpoint's content does not match the digest stored with it."""


class StepCheckError(AssertionError):
  """A step's result disagreed with the user's independent check."""


class ReplayMismatchError(AssertionError):
  """A replay from a checkpoint diverged from the uninterrupted run."""


def fallback_advice(directory: str, step: int, committed: list[int]) -> str:
  """What to do when committed checkpoint `step` in `directory` is unusable."""
  older = [s for s in committed if s < step]
  path = os.path.join(directory, str(step))
  if older:
    return (f'Move {path} out of the folder to resume from the previous '
            f'checkpoint (step {older[-1]}), or {START_FRESH}.')
  return f'No older checkpoint exists here; {START_FRESH}.'
