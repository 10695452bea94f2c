"""Nothing outlives the launcher: parent-death signals, a subreaper, orphan collection (Linux).

* `die_with_launcher`: wraps a command so the child gets SIGKILL when the
  launcher dies, even by SIGKILL (`PR_SET_PDEATHSIG`, set by a tiny exec
  wrapper rather than a `preexec_fn`, which would fork this multithreaded
  process).
* `become_subreaper`: orphaned descendants of the controllers are
  re-parented to the launcher instead of init (`PR_SET_CHILD_SUBREAPER`),
  so `collect` can reap them.
* `collect`: SIGKILLs what is left of the controllers' process groups and
  reaps the orphans of those groups that were re-parented here.

Elsewhere than Linux these do nothing.
"""

from __future__ import annotations

import collections.abc
import ctypes
import ctypes.util
import errno
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

_libc = None
if sys.platform.startswith('linux'):
  try:
    _libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6',
                        use_errno=True)
  except OSError:
    _libc = None


def become_subreaper() -> bool:
  """Makes this process the reaper of its orphaned descendants; False if unsupported."""
  if _libc is None:
    return False
  return _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


# Run as `python -I -S -c _WRAPPER LAUNCHER_PID PROGRAM ARGV0 ARGS...`: sets
# the parent-death signal, then becomes the command (same pid). Stdlib only,
# so it starts in milliseconds.
_WRAPPER = """\
import ctypes, os, signal, sys
parent, program, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
ctypes.CDLL(None, use_errno=True).prctl(%d, signal.SIGKILL, 0, 0, 0)
if os.getppid() != parent:
  os._exit(1)
try:
  os.execv(program, argv)
except OSError as e:
  sys.stderr.write('multihost.launch: cannot run %%r: %%s\\n' %% (argv[0], e.strerror))
  os._exit(127 if isinstance(e, FileNotFoundError) else 126)
""" % _PR_SET_PDEATHSIG


def _resolve(program: str, *, env: collections.abc.Mapping[str, str],
             cwd: str | os.PathLike[str] | None) -> str:
  """The file `program` names, looked up as `subprocess.Popen` would; raises its OSError if none runs."""
  if os.path.dirname(program):
    candidates = [program]
  else:
    candidates = [os.path.join(d, program) for d in os.get_exec_path(env)]
  error = None
  for candidate in candidates:
    where = os.path.join(cwd, candidate) if cwd is not None else candidate
    if os.path.isfile(where) and os.access(where, os.X_OK):
      return candidate
    if error is None and os.path.exists(where):
      error = PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
  raise error or FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT),
                                    program)


def die_with_launcher(command: collections.abc.Sequence[str], *,
                      env: collections.abc.Mapping[str, str],
                      cwd: str | os.PathLike[str] | None = None) -> list[str]:
  """`command` wrapped so it ends when this process dies (pid unchanged); `command` itself if unsupported.

  The wrapper execs the command, so the spawned pid is the command's. The
  kernel sends the signal when the thread that spawned the child exits, so
  the wrapper is used only from the main thread (which lives as long as the
  launcher).

  Raises:
    FileNotFoundError, PermissionError: the command's program cannot run
      (as `subprocess.Popen` raises them for an unwrapped command).
  """
  if _libc is None or threading.current_thread() is not threading.main_thread():
    return list(command)
  program = _resolve(command[0], env=env, cwd=cwd)
  return [sys.executable, '-I', '-S', '-c', _WRAPPER, str(os.getpid()),
          program, *command]


def kill_group(pgid: int, sig: int) -> None:
  """Signals process group `pgid`, if any member is left."""
  try:
    os.killpg(pgid, sig)
  except (ProcessLookupError, PermissionError):
    pass


def _children() -> list[int]:
  pids: list[int] = []
  try:
    for task in os.listdir('/proc/self/task'):
      with open(f'/proc/self/task/{task}/children') as f:
        pids.extend(int(p) for p in f.read().split())
  except OSError:
    pass
  return pids


def _pgid(pid: int) -> int | None:
  try:
    with open(f'/proc/{pid}/stat') as f:
      return int(f.read().rsplit(')', 1)[1].split()[2])
  except (OSError, ValueError, IndexError):
    return None


def collect(pgids: list[int], *, timeout: float = 5.0) -> None:
  """SIGKILLs the groups `pgids` and reaps their members re-parented here."""
  for pgid in pgids:
    kill_group(pgid, signal.SIGKILL)
  groups = set(pgids)
  deadline = time.monotonic() + timeout
  while True:
    mine = [p for p in _children() if _pgid(p) in groups]
    for pid in mine:
      try:
        os.waitpid(pid, os.WNOHANG)
      except ChildProcessError:
        pass
    if not mine or time.monotonic() > deadline:
      return
    time.sleep(0.02)
