"""Atomic, symlink-safe file writes: the one writer every part uses (trace files, the local checkpoint tier, locks).

JAX-free (the launcher uses it). A write goes to a temporary file in the
target's own folder, under an unpredictable name, created exclusively and
without following a link (`O_CREAT | O_EXCL | O_NOFOLLOW`), is flushed to
disk, and then renamed over the target, so a reader sees the old file or the
new one, never a part; a link planted at the temporary name or at the target
is never written through (a rename replaces the link itself). On any failure
the temporary file is removed.
"""

from __future__ import annotations

import contextlib
import os
import secrets

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, 'O_NOFOLLOW', 0)


def temporary_name(path: str | os.PathLike) -> str:
  """An unpredictable name beside `path`, in the same folder: `.NAME.tmp-<random>`."""
  folder, name = os.path.split(os.fspath(path))
  return os.path.join(folder, f'.{name}.tmp-{secrets.token_hex(8)}')


def fsync_folder(folder: str | os.PathLike) -> None:
  """Flushes `folder`'s entries (a rename in it) to disk, where the platform allows (never through a link)."""
  try:
    fd = os.open(os.fspath(folder) or '.', os.O_RDONLY | os.O_DIRECTORY
                 | getattr(os, 'O_NOFOLLOW', 0))
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def write_atomic(path: str | os.PathLike, data: bytes | str, *,
                 mode: int = 0o644, sync: bool = True) -> None:
  """Replaces `path`'s contents with `data` at once: readers see the old file or the new one.

  Args:
    path: the file to write; its folder must exist.
    data: the contents (a str is written as UTF-8).
    mode: the new file's permission bits (before the umask).
    sync: flush the file and its folder to disk before returning.

  Raises:
    OSError: the folder is missing or not writable, or the disk is full; the
      target is then unchanged and no temporary file is left. Its
      `filename` is `path` (never the temporary name, which means nothing
      to the reader).
  """
  path = os.fspath(path)
  if isinstance(data, str):
    data = data.encode()
  tmp = temporary_name(path)
  try:
    fd = os.open(tmp, _FLAGS, mode)
    try:
      try:
        view = memoryview(data).cast('B')
        while view:
          view = view[os.write(fd, view):]
        if sync:
          os.fsync(fd)
      finally:
        os.close(fd)
      os.replace(tmp, path)
    except BaseException:
      with contextlib.suppress(OSError):
        os.unlink(tmp)
      raise
  except OSError as e:
    if e.errno is None:
      raise
    # Named by the target: the temporary name means nothing to the reader.
    raise OSError(e.errno, e.strerror, path) from e
  if sync:
    fsync_folder(os.path.dirname(path))
