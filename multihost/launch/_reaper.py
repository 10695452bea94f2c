"""Nothing outlives the launcher: parent-death signals, a subreaper, orphan collection (Linux).

* `die_with_launcher` (a `preexec_fn`): the child gets SIGKILL when the
  launcher dies, even by SIGKILL (`PR_SET_PDEATHSIG`).
* `become_subreaper`: orphaned descendants of the controllers are
  re-parented to the launcher instead of init (`PR_SET_CHILD_SUBREAPER`),
  so `collect` can reap them.
* `collect`: SIGKILLs what is left of the controllers' process groups and
  reaps the orphans of those groups that were re-parented here.

Elsewhere than Linux these do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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


def die_with_launcher():
  """A `preexec_fn` that ends the child when this process dies; None if unsupported.

  The kernel sends the signal when the thread that forked the child exits,
  so it is used only from the main thread (which lives as long as the
  launcher).
  """
  if _libc is None or threading.current_thread() is not threading.main_thread():
    return None
  parent = os.getpid()
  libc = _libc

  def preexec() -> None:
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # The launcher died before prctl.
      os._exit(1)

  return preexec


def kill_group(pgid: int, sig: int) -> None:
  """Signals process group `pgid`, if any member is left."""
  try:
    os.killpg(pgid, sig)
  except (ProcessLookupError, PermissionError):
    pass


def _children() -> list[int]:
  pids = []
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
