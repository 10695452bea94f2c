"""An exclusive lock on a checkpoint folder, held by process 0 for a whole run.

The lock is a file, `.recovery-lock`, that names its holder (host, pid, the
pid's start time, the time taken, a fresh nonce) and stays flock'ed while
held. Every other process looks for it, nonce and all, to confirm that it
sees the same folder. A second run on the same folder is refused with the
holder's name.

Taking it is atomic, also over a lock left by a run that died: a new lock
file is created with O_EXCL (atomic on local and NFSv3+ folders); an
existing one is taken only by whoever holds its flock, and only after
checking, under that flock, that the path still names the locked file
(`release` unlinks it) and that its holder is gone. A stale holder is one
that ran on this host and whose process is gone (or its pid now belongs to
another process). A lock from another host is never taken over: remove it
by hand once that run is known to be gone. Content that cannot be read as a
holder fails closed (refused). The lock file is opened without following
links, so a planted symlink is refused, never written through.
"""

from __future__ import annotations

from collections.abc import Callable
import errno
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
from recovery._src.checkpoint import shared_folder
from recovery._src.state.errors import CheckpointError
from recovery._src.state.errors import CheckpointFolderError

LOCK_NAME = '.recovery-lock'
# How long a run that just created the lock file waits for its flock, which
# a contender may hold for the moment it takes to read the file and refuse.
_CREATE_FLOCK_WAIT_S = 5.0
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def _proc_start(pid: int) -> str | None:
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _alive(holder: dict) -> bool:
  try:
    pid = int(holder.get('pid', -1))
  except (TypeError, ValueError):
    return True  # Unreadable: fail closed.
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except (PermissionError, OverflowError, ValueError):
    return True
  start = holder.get('proc_start')
  now = _proc_start(pid)
  return start is None or now is None or start == now


def _describe(holder: dict) -> str:
  try:
    when = time.strftime('%Y-%m-%d %H:%M:%S',
                         time.localtime(float(holder.get('time', 0))))
  except (TypeError, ValueError, OverflowError):
    when = '(unknown time)'
  return (f'host {holder.get("host")!r}, pid {holder.get("pid")}, since '
          f'{when}')


def _read(fd: int) -> dict | None:
  """The holder a lock file names: {} when empty, None when unreadable."""
  try:
    raw = os.pread(fd, 1 << 16, 0)
    holder = json.loads(raw.decode() or '{}')
  except (OSError, ValueError):
    return None
  return holder if isinstance(holder, dict) else None


def _flock(fd: int) -> bool | None:
  """Tries the lock file's flock: True taken, False held, None unsupported."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return True
  except OSError as e:
    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      return False
    return None


def _names(fd: int, path: str) -> bool:
  """Whether `path` still names the open file `fd` (not removed, not replaced)."""
  try:
    st = os.lstat(path)
  except OSError:
    return False
  mine = os.fstat(fd)
  return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _in_use(path: str, holder: dict | None) -> CheckpointFolderError:
  who = (_describe(holder) if holder else
         'a run that is taking it now' if holder == {} else
         'unreadable lock content')
  return CheckpointFolderError(
      f'Checkpoint folder {os.path.dirname(path)} is in use by another run '
      f'({who}; lock file {path}). Wait for it to finish, or use another '
      'folder. If that run is gone (e.g. on another host), remove the lock '
      'file by hand.')


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
    folder (`checkpoint.shared_folder.check`: one all-gather). A single process just
    takes the lock.

    Raises:
      CheckpointFolderError: another live run holds the folder (named), some
        process does not see the folder process 0 locked (named), or the
        lock cannot be taken.
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
        raise CheckpointFolderError(refusal)
      if shared:
        shared_folder.check(directory, LOCK_NAME,
                             seen=lambda: cls.nonce_at(path) == nonce)
    except BaseException:
      lock.release()
      raise
    return lock, listed

  @classmethod
  def _take(cls, path: str) -> FolderLock:
    info = {'host': socket.gethostname(), 'pid': os.getpid(),
            'proc_start': _proc_start(os.getpid()), 'time': time.time(),
            'nonce': secrets.token_hex(8)}
    for _ in range(5):
      try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW,
                     0o644)
        created = True
      except FileExistsError:
        try:
          fd = os.open(path, os.O_RDWR | _NOFOLLOW)
        except FileNotFoundError:
          continue  # Released since; try to create it again.
        except OSError as e:
          raise CheckpointFolderError(
              f'Cannot open the checkpoint folder lock {path} '
              f'({e.strerror or e}); it must be a regular file, not a '
              'symlink. Remove it by hand if no run holds the folder.'
          ) from None
        created = False
      try:
        lock = cls._claim(path, fd, info, created=created)
      except BaseException:
        os.close(fd)
        raise
      if lock is not None:
        return lock
      os.close(fd)  # Removed or replaced while we opened it: again.
    raise CheckpointFolderError(
        f'Could not take the checkpoint folder lock {path}: it kept changing; '
        'another run is starting here.')

  @classmethod
  def _claim(cls, path: str, fd: int, info: dict, *,
             created: bool) -> FolderLock | None:
    """Holds `fd`'s flock and writes `info`, or raises; None to try again."""
    got = _flock(fd)
    if created:
      deadline = time.monotonic() + _CREATE_FLOCK_WAIT_S
      while got is False and time.monotonic() < deadline:
        time.sleep(0.005)  # A contender reads our empty file and refuses.
        got = _flock(fd)
      if got is False:
        raise _in_use(path, _read(fd))
    else:
      if got is False:
        raise _in_use(path, _read(fd))
      if not _names(fd, path):
        return None
      holder = _read(fd)
      if not holder or holder.get('host') != info['host'] or _alive(holder):
        raise _in_use(path, holder)
      if got is None:
        raise CheckpointFolderError(
            f'Checkpoint folder lock {path} was left by {_describe(holder)}, '
            'which is gone, but this filesystem has no flock, so it cannot be '
            'taken over safely. Remove the lock file by hand.')
      logging.warning('Checkpoint folder lock %s was left by %s, which is '
                      'gone; taking it over.', path, _describe(holder))
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    os.fsync(fd)
    return cls(path, fd, info)

  @staticmethod
  def nonce_at(path: str) -> str | None:
    """The nonce of the lock file at `path`, read without following links."""
    try:
      fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError:
      return None
    try:
      return (_read(fd) or {}).get('nonce')
    finally:
      os.close(fd)

  def release(self) -> None:
    """Removes the lock file if this run still holds it."""
    if self._fd is None:
      return
    try:
      # Unlinked before the flock is dropped (at close): a contender that
      # opened the file meanwhile finds the path no longer names it.
      if _names(self._fd, self.path) and _read(self._fd) == self._info:
        os.remove(self.path)
    except OSError:
      pass
    finally:
      os.close(self._fd)
      self._fd = None
