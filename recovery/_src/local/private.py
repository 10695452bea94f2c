"""A host's local checkpoint folder, private and identified: owner-only folders, no links followed, the folder's identity, a folder replaced with no moment without one (`replace_folder`).

`<local>` and each `process_<P>` must be real folders of this user that its
group and others cannot write (`check_private`; created owner-only, mode
0700, by `ensure_private`). Since no other user can add or swap entries in
such a folder, an entry checked with lstat can then be used by its path;
files are opened with O_NOFOLLOW (`open_file`), so a link is never
followed.

The processes that share `<local>` (one disk) find each other through it:
the first to open it draws a random identity and links it into place
atomically, and every process reads back the one in place (`folder_id`,
kept in `<local>/.recovery-local-disk`). It outlives restarts with the
folder; a wiped or new folder draws a new one. Pure file handling: no
collective, no JAX.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import stat

from multihost.files import fsync_folder
from recovery._src.state.errors import CheckpointFolderError

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
# The local folder's identity: 16 random hex digits, one line.
FOLDER_ID_FILE = '.recovery-local-disk'
# An identity (the folder's, a run's: `run_identity.new`): 16 random hex digits.
IDENTITY = re.compile(r'[0-9a-f]{16}')
# A temporary name's infix (this module's identity file, `folder`'s steps in
# writing).
TMP = '.tmp-'


def new_identity() -> str:
  """A fresh identity (`IDENTITY`)."""
  return secrets.token_hex(8)


def check_private(path: str) -> None:
  """Returns if `path` is a real folder of this user that no one else can write.

  Raises:
    CheckpointFolderError: it is missing, a symlink or no folder, another
      user's, or writable by its group or others; the message names the path,
      what it is and the fix.
  """
  try:
    st = os.lstat(path)
  except OSError as e:
    raise CheckpointFolderError(
        f'Local checkpoint folder {path} cannot be read ({e.strerror or e}). '
        'Pick a local folder this user can create and write.') from None
  if stat.S_ISLNK(st.st_mode):
    try:
      target = os.readlink(path)
    except OSError:
      target = '?'
    raise CheckpointFolderError(
        f'Local checkpoint folder {path} is a symlink (to {target}): the '
        'local tier never follows a link under its folder, so that it cannot '
        'write or delete anything elsewhere. Remove the link (a real folder '
        'is created in its place), or pass the real folder.')
  if not stat.S_ISDIR(st.st_mode):
    raise CheckpointFolderError(
        f'Local checkpoint folder {path} is not a folder (mode '
        f'{oct(st.st_mode)}). Move it away or pick another local folder.')
  if st.st_uid != os.geteuid():
    raise CheckpointFolderError(
        f'Local checkpoint folder {path} is owned by uid {st.st_uid}, not by '
        f'this user (uid {os.geteuid()}): its owner could plant or delete '
        'local steps. Use a folder of your own (a new one is created '
        'owner-only, mode 0700).')
  if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    raise CheckpointFolderError(
        f'Local checkpoint folder {path} is writable by its group or others '
        f'(mode {oct(stat.S_IMODE(st.st_mode))}): they could plant or delete '
        f'local steps. Run `chmod 700 {path}`, or use a new folder (created '
        'owner-only, mode 0700).')



def ensure_private(path: str) -> None:
  """Creates folder `path` owner-only (mode 0700) if missing; then `check_private`."""
  with contextlib.suppress(FileExistsError):
    os.mkdir(path, 0o700)
  check_private(path)



def open_file(path: str, flags: int, mode: int = 0o600):
  return os.fdopen(os.open(path, flags | _NOFOLLOW, mode),
                   'wb' if flags & os.O_WRONLY else 'rb')


def _read_folder_id(path: str) -> str | None:
  """The identity in marker `path`; None if there is no marker.

  Raises:
    CheckpointFolderError: the marker is a link, no regular file, unreadable
      or holds no identity.
  """
  try:
    st = os.lstat(path)
  except FileNotFoundError:
    return None
  except OSError as e:
    raise CheckpointFolderError(
        f'The local folder\'s identity {path} cannot be read '
        f'({e.strerror or e}). Check the local folder.') from None
  if not stat.S_ISREG(st.st_mode):
    raise CheckpointFolderError(
        f'The local folder\'s identity {path} is not a regular file (mode '
        f'{oct(st.st_mode)}; never followed if a link). Remove it: the next '
        'start draws a new identity.')
  try:
    with open_file(path, os.O_RDONLY) as f:
      text = f.read(64).decode('ascii', 'replace').strip()
  except OSError as e:
    raise CheckpointFolderError(
        f'The local folder\'s identity {path} cannot be read '
        f'({e.strerror or e}). Check the local folder.') from None
  if IDENTITY.fullmatch(text) is None:
    raise CheckpointFolderError(
        f'The local folder\'s identity {path} holds {text[:40]!r}, not 16 hex '
        'digits. Remove it when no run uses the folder: the next start draws '
        'a new identity.')
  return text


def folder_id(local: str) -> str:
  """The identity of local folder `local`: the same for every process that opens the same folder.

  16 hex digits kept in `<local>/.recovery-local-disk`. The first process
  to open the folder draws them (`secrets.token_hex`), writes them to a
  temporary file of an unpredictable name (created with O_EXCL and
  O_NOFOLLOW, fsynced) and links that into place, which fails when another
  process was first; every process then reads back the identity in place,
  so processes that start at once on one disk agree. Processes that see
  different folders at the same path (a disk each) read different ones.
  The identity outlives restarts with the folder; a wiped or new folder
  draws a new one (it no longer holds what the old one held).

  Raises:
    CheckpointFolderError: `local` fails `check_private`; the marker is a
      link, no regular file or no identity; or it cannot be written.
  """
  check_private(local)
  path = os.path.join(local, FOLDER_ID_FILE)
  found = _read_folder_id(path)
  if found is not None:
    return found
  tmp = os.path.join(local, f'{FOLDER_ID_FILE}{TMP}{new_identity()}')
  try:
    with open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL) as f:
      f.write(f'{new_identity()}\n'.encode())
      f.flush()
      os.fsync(f.fileno())
    with contextlib.suppress(FileExistsError):  # Another process was first.
      os.link(tmp, path, follow_symlinks=False)
    fsync_folder(local)
  except OSError as e:
    raise CheckpointFolderError(
        f'Cannot write the local folder\'s identity {path} '
        f'({e.strerror or e}). The local folder must be writable by this '
        'user.') from None
  finally:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
  found = _read_folder_id(path)
  if found is None:
    raise CheckpointFolderError(
        f'The local folder\'s identity {path} vanished right after it was '
        'written: something else is deleting files in the local folder. '
        'Give this run a local folder of its own.')
  return found


# renameat2's flag that swaps two paths (Linux 3.15+), and "this directory".
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: str, b: str) -> bool:
  """Swaps entries `a` and `b` in one atomic step (renameat2 RENAME_EXCHANGE); False, and nothing done, where the C library or the filesystem cannot.

  Raises:
    OSError: the swap failed otherwise.
  """
  try:
    rename = ctypes.CDLL(None, use_errno=True).renameat2
  except (OSError, AttributeError):
    return False
  rename.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                     ctypes.c_char_p, ctypes.c_uint]
  rename.restype = ctypes.c_int
  if rename(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b),
            _RENAME_EXCHANGE) == 0:
    return True
  error = ctypes.get_errno()
  if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
    return False
  raise OSError(error, os.strerror(error), a)


def replace_folder(new: str, final: str) -> None:
  """Puts folder `new` at `final` (an existing folder) and the old one at `new`, for the caller to remove; `final` is never without one of them.

  One atomic swap (`exchange`) where the filesystem has it. Else three
  renames: the old folder to `<new>0`, `new` to `final`, the old folder to
  `new`; a kill between the first two leaves both under temporary names
  (the local folder's `remove_tmp` puts the newer committed one back).
  """
  if exchange(new, final):
    return
  aside = f'{new}0'
  os.rename(final, aside)
  try:
    os.rename(new, final)
  except BaseException:
    os.rename(aside, final)
    raise
  os.rename(aside, new)
