"""A run's identity: drawn at a fresh start, kept in the checkpoint folder across restarts, carried by every local step (`local.folder`), so that a run acts only on its own local steps."""

from __future__ import annotations

import os
from typing import Any
from typing import TypeGuard

from multihost.files import write_atomic
from recovery._src.local import private

# The run's identity, in the checkpoint folder: drawn at a fresh start (or
# when missing), kept across restarts, written into every local step's
# manifest and folder name. Restore, keep-N and a re-save of a step act only
# on this run's steps, so a step this run did not write is never taken: one
# an earlier run of the folder left on a host that this run's fresh start
# did not reach, another run's in a shared local folder, one copied in. An
# authenticated manifest (a MAC) would need a key that a restarted run finds
# and a planter does not, i.e. kept where this identity is kept; and the
# local folder is owner-only (`private.check_private`), so no other user can
# plant a step there at all. The identity is the simpler of the two, and as
# sound.
RUN_FILE = '.recovery-local-run'


def read(directory: str) -> str | None:
  """The run identity kept in checkpoint folder `directory`, if a valid one."""
  try:
    fd = os.open(os.path.join(directory, RUN_FILE),
                 os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd) as f:
      run = f.read(64).strip()
  except (OSError, UnicodeDecodeError):
    return None
  return run if is_run(run) else None


def write(directory: str, run: str) -> str | None:
  """Keeps `run` as the identity of checkpoint folder `directory`'s run; None, or the error."""
  path = os.path.join(directory, RUN_FILE)
  try:
    write_atomic(path, run + '\n', mode=0o600)
  except OSError as e:
    return (f'Cannot write the run identity of the local tier to {path} '
            f'({e.strerror or e}). The checkpoint folder must be writable '
            'by this user.')
  return None


def new() -> str:
  """A fresh run identity: 16 random hex digits."""
  return private.new_identity()


def is_run(value: Any) -> TypeGuard[str]:
  """Whether `value` is a run identity (16 lowercase hex digits)."""
  return isinstance(value, str) and private.IDENTITY.fullmatch(value) is not None
