"""Checks that every process sees the same checkpoint folder (a filesystem every host sees)."""

from __future__ import annotations

from collections.abc import Callable
import os

import numpy as np

import multihost
from multihost import process_prefix as _prefix
from recovery._src.state.errors import CheckpointFolderError


def check(directory: str, name: str, *, seen: Callable[[], bool]) -> None:
  """Raises `CheckpointFolderError` on every process unless `seen()` holds on all.

  Collective: every process must call this, in the same order (one
  all-gather). `seen()` tells whether this process sees the file `name`
  that process 0 wrote in `directory` (with the content it wrote).
  """
  sees = np.asarray(multihost.process_allgather(np.array(bool(seen()))))
  blind = [p for p, ok in enumerate(sees.reshape(-1)) if not ok]
  if blind:
    raise CheckpointFolderError(
        f'{_prefix()} Checkpoint folder {directory} is not shared: process(es) '
        f'{blind} do not see the file process 0 wrote there '
        f'({os.path.join(directory, name)}). Every process must see the same '
        'folder: put checkpoints on a filesystem every host mounts (NFS, '
        'Lustre, a cloud bucket through Orbax), at the same path.')
