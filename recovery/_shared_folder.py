"""Checks that every process sees the same checkpoint folder (a filesystem every host sees)."""

from __future__ import annotations

import os
import secrets

import jax
import numpy as np

import multihost
from multihost.lowlevel import process_prefix as _prefix
from recovery._errors import CheckpointError

_MARKER = '.shared-folder-probe-{}'


def check(directory: str) -> None:
  """Raises `CheckpointError` unless every process sees process 0's marker file in `directory`.

  Collective: every process must call this, in the same order. Process 0
  writes a marker named by a fresh nonce, broadcasts the nonce, every process
  looks for the file, and process 0 deletes it. A single process returns at
  once.
  """
  if jax.process_count() == 1:
    return
  nonce = np.zeros(16, np.uint8)
  path = None
  if jax.process_index() == 0:
    nonce = np.frombuffer(secrets.token_hex(8).encode(), np.uint8).copy()
    path = os.path.join(directory, _MARKER.format(nonce.tobytes().decode()))
    with open(path, 'w') as f:
      f.write('multihost recovery: shared-folder probe\n')
  nonce = np.asarray(multihost.broadcast_one_to_all(nonce))
  mine = os.path.join(directory, _MARKER.format(nonce.tobytes().decode()))
  seen = np.asarray(multihost.process_allgather(
      np.array(os.path.exists(mine))))
  if path is not None:
    try:
      os.remove(path)
    except OSError:
      pass
  blind = [p for p, ok in enumerate(seen.reshape(-1)) if not ok]
  if blind:
    raise CheckpointError(
        f'{_prefix()} Checkpoint folder {directory} is not shared: process(es) '
        f'{blind} do not see the marker file process 0 wrote there '
        f'({os.path.basename(mine)}). Every process must see the same folder: '
        'put checkpoints on a filesystem every host mounts (NFS, Lustre, a '
        'cloud bucket through Orbax), at the same path.')
