"""An exclusive lock on a checkpoint folder, held by process 0 for a whole run.

The lock is a file, `.recovery-lock`, created with O_EXCL (atomic on local
and NFSv3+ folders) that names its holder (host, pid, the pid's start time,
the time taken, a fresh nonce) and stays flock'ed while held. Every other
process looks for it, nonce and all, to confirm that it sees the same
folder. A second run on the same folder is refused with the holder's name.
A lock left by a run that died is stale when its holder ran on this host
and that process is gone (or its pid now belongs to another process); it is
then taken over, with a warning. A lock from another host is never taken
over: remove it by hand once that run is known to be gone.
"""

from __future__ import annotations

from collections.abc import Callable
import fcntl
import json
import os
import secrets
import socket
import time
from typing import Any

from absl import logging
import jax
import multihost

from recovery import _shared_folder
from recovery._errors import CheckpointError

LOCK_NAME = '.recovery-lock'


def _proc_start(pid: int) -> str | None:
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _alive(holder: dict) -> bool:
  pid = int(holder.get('pid', -1))
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  start = holder.get('proc_start')
  now = _proc_start(pid)
  return start is None or now is None or start == now


def _describe(holder: dict) -> str:
  when = time.strftime('%Y-%m-%d %H:%M:%S',
                       time.localtime(float(holder.get('time', 0))))
  return (f'host {holder.get("host")!r}, pid {holder.get("pid")}, since '
          f'{when}')


class FolderLock:
  """Process 0's lock on a checkpoint folder (other processes hold nothing)."""

  def __init__(self, path: str, fd: int | None, info: dict | None):
    self.path = path
    self._fd = fd
    self._info = info

  @classmethod
  def acquire(cls, directory: str, *, listing: Callable[[], Any] = lambda: None
              ) -> tuple[FolderLock, Any]:
    """Takes the folder's lock; returns it and process 0's `listing()`.

    Collective: every process must call this, in the same order.

    Process 0 takes the lock and calls `listing()` while holding it. One
    broadcast gives every process the outcome, the lock's nonce and that
    listing (so that every process holds the same one); then every process
    confirms that it sees the lock file with that nonce, i.e. the same
    folder (`_shared_folder.check`: one all-gather). A single process just
    takes the lock.

    Raises:
      CheckpointError: another live run holds the folder (named), or some
        process does not see the folder process 0 locked (named).
    """
    path = os.path.join(directory, LOCK_NAME)
    lock, refusal, listed = cls(path, None, None), None, None
    if jax.process_index() == 0:
      try:
        lock = cls._take(path)
        listed = listing()
      except CheckpointError as e:
        refusal = str(e)
      except Exception as e:  # pylint: disable=broad-except
        lock.release()  # Every process raises, not only this one.
        refusal = (f'Process 0 could not take the checkpoint folder lock '
                   f'{path}: {type(e).__name__}: {e}')
    shared = jax.process_count() > 1
    nonce = lock._info['nonce'] if lock._info else None
    try:
      if shared:
        refusal, nonce, listed = multihost.broadcast_object(
            (refusal, nonce, listed))
      if refusal:
        raise CheckpointError(refusal)
      if shared:
        _shared_folder.check(
            directory, LOCK_NAME,
            seen=lambda: cls._holder(path).get('nonce') == nonce)
    except BaseException:
      lock.release()
      raise
    return lock, listed

  @classmethod
  def _take(cls, path: str) -> FolderLock:
    info = {'host': socket.gethostname(), 'pid': os.getpid(),
            'proc_start': _proc_start(os.getpid()), 'time': time.time(),
            'nonce': secrets.token_hex(8)}
    for _ in range(2):
      try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
      except FileExistsError:
        holder = cls._holder(path)
        if (holder.get('host') == info['host'] and not _alive(holder)
            and cls._unlocked(path)):
          logging.warning('Checkpoint folder lock %s was left by %s, which is '
                          'gone; taking it over.', path, _describe(holder))
          try:
            os.remove(path)
          except FileNotFoundError:
            pass
          continue
        raise CheckpointError(
            f'Checkpoint folder {os.path.dirname(path)} is in use by another '
            f'run ({_describe(holder)}; lock file {path}). Wait for it to '
            'finish, or use another folder. If that run is gone (e.g. on '
            'another host), remove the lock file by hand.') from None
      os.write(fd, json.dumps(info).encode())
      os.fsync(fd)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError:
        pass  # e.g. a file system without flock; the O_EXCL file suffices
      return cls(path, fd, info)
    raise CheckpointError(f'Could not take the checkpoint folder lock {path}.')

  @staticmethod
  def _holder(path: str) -> dict:
    try:
      with open(path) as f:
        return json.loads(f.read() or '{}')
    except (OSError, ValueError):
      return {}

  @staticmethod
  def _unlocked(path: str) -> bool:
    """Whether nobody on this host holds the lock file flock'ed."""
    try:
      fd = os.open(path, os.O_RDONLY)
    except OSError:
      return True
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      return True
    except OSError:
      return False
    finally:
      os.close(fd)

  def release(self) -> None:
    """Removes the lock file if this run still holds it."""
    if self._fd is None:
      return
    try:
      if self._holder(self.path) == self._info:
        os.remove(self.path)
    except OSError:
      pass
    finally:
      os.close(self._fd)
      self._fd = None
