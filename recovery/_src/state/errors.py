"""Every error `recovery` raises, the advice its messages end with, and how a message quotes another error (`shorten`).

The advice ("what to do now") is written here once, in terms of recovery's
own API, so the checkpoint folder and the loop tell the user the same thing.
A binary that exposes these options under its own names (flags) adds them to
the messages it prints; the subclasses tell it which advice applies.
"""

from __future__ import annotations

# How to continue after a stop (preemption, Ctrl-C, a failure): a sentence.
RESUME_TO_CONTINUE = (
    "Start again on this folder with Checkpoints.start(resume=True) (or "
    "resume='if_present') to continue.")
# How to begin again when a folder cannot be used.
START_FRESH = 'start fresh in a new folder'


def shorten(message: object, limit: int = 400) -> str:
  """`message` (a string or an exception) on one line, cut to `limit` characters: how a message quotes another error."""
  text = ' '.join(str(message).split())
  return text if len(text) <= limit else text[:limit] + '...'


class CheckpointError(RuntimeError):
  """A checkpoint is missing, unreadable, partial, or does not fit this run."""


class CheckpointDamagedError(CheckpointError):
  """A committed checkpoint's files cannot be read, or it fails its digest check.

  `Checkpoints.start` sets such a step aside and resumes from the newest
  older one that verifies when it may fall back (resume='if_present', or a
  restart); otherwise it raises this.

  Attributes:
    why: the finding in a few words, for a log line ('its files cannot be
      read (...)'); the message when none was given.
  """

  def __init__(self, message: str, why: str = ''):
    super().__init__(message)
    self.why = why or message


class CheckpointCorruptError(CheckpointDamagedError):
  """A checkpoint's content does not match the digest stored with it."""


class CheckpointFolderError(CheckpointError):
  """The folder cannot be used: not writable, not shared, or in use."""


class NothingToResumeError(CheckpointError):
  """A strict resume (`resume=True`) found no committed checkpoint."""


class FolderNotFreshError(CheckpointError):
  """A strict fresh start (`resume=False`) found committed checkpoints, or local steps of the folder."""


class CheckpointMismatchError(CheckpointError):
  """A checkpoint's leaves do not fit the target (another model or data): a mistake of the run, never damage (nothing is set aside)."""


class StepCheckError(AssertionError):
  """A step's result disagreed with the user's independent check."""


class ReplayMismatchError(AssertionError):
  """A replay from a checkpoint diverged from the uninterrupted run."""


# What a damaged step is renamed to when it is set aside: `<step>` + this +
# the UTC time (not all digits, so never read as a step, never deleted).
DAMAGED_SUFFIX = '.damaged-'


def fallback_advice(directory: str, step: int, committed: list[int]) -> str:
  """What to do when committed checkpoint `step` in `directory` is unusable."""
  older = [s for s in committed if s < step]
  if older:
    return (f"Start with resume='if_present' (the default on a restart) to "
            f'set it aside (renamed {step}{DAMAGED_SUFFIX}<UTC time> in '
            f'{directory}, kept) and resume from the previous checkpoint '
            f'(step {older[-1]}), or {START_FRESH}.')
  return f'No older checkpoint exists here; {START_FRESH}.'
