"""Controller processes: spawns them in their own sessions, reaps them, signals and stops them.

(cf. torchrun's `multiprocessing/api.py`.) Knows nothing of the run's
policy: `Processes` starts N copies of a command, records when and how each
exits (one reaper thread each) and captures their output (`Output`), and
`stop()` ends whatever still runs (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import collections.abc
import os
import signal
import subprocess
import threading
import time
from typing import TextIO

from multihost import env as env_lib
from multihost.launch._src.processes import output as _output
from multihost.launch._src.processes import reaper as _reaper


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
  """Signals the process group the launcher created for `proc` (its pid if the group is gone).

  The group is signalled even after its leader exited: its other members
  (the controller's children) may still run.
  """
  if proc.returncode is not None:
    _reaper.kill_group(proc.pid, sig)
    return
  try:
    os.killpg(proc.pid, sig)  # pgid == pid: start_new_session=True.
  except (ProcessLookupError, PermissionError):
    try:
      os.kill(proc.pid, sig)
    except ProcessLookupError:
      pass


def exited(pid: int) -> bool:
  """Whether child `pid` has exited, reaped or not (a zombie is not reaped: `waitid` with WNOWAIT leaves it)."""
  try:
    return os.waitid(os.P_PID, pid,
                     os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
  except ChildProcessError:  # Reaped already.
    return True


class Processes:
  """N running processes, each in its own session, watched by a reaper and an output thread.

  Each process runs in its own session (process group), so a Ctrl-C on the
  terminal reaches only the launcher; stopping a process signals its group,
  which holds only that process and its descendants.

  Args:
    num_processes: number of processes.
    stream: where to stream the `[pN] `-prefixed output (None: capture only).
    quiet_gloo: drop gloo's connection lines from the output (`Output`).
  """

  def __init__(self, num_processes: int, *, stream: TextIO | None = None,
               quiet_gloo: bool = True):
    self.num_processes = num_processes
    self.changed = threading.Condition(threading.Lock())
    self.output = _output.Output(num_processes, changed=self.changed,
                                 stream=stream, quiet_gloo=quiet_gloo)
    self.start_time = time.monotonic()
    self._procs: list[subprocess.Popen[bytes]] = []
    self._pumps: list[threading.Thread] = []
    self._threads: list[threading.Thread] = []
    self._returncodes: list[int | None] = [None] * num_processes
    self._ended: list[float | None] = [None] * num_processes
    self._stopped: set[int] = set()
    _reaper.become_subreaper()

  def spawn(self, command: collections.abc.Sequence[str], *,
            env: collections.abc.Mapping[str, str],
            cwd: str | os.PathLike[str] | None = None) -> None:
    """Starts the next process (index = how many were started) in a new session."""
    index = len(self._procs)
    # The pytest plugin's workers watch their parent themselves (and clean
    # up their results folder); every other child dies with us.
    if not env.get(env_lib.PYTEST_WORKER):
      command = _reaper.die_with_launcher(command, env=env, cwd=cwd)
    proc = subprocess.Popen(
        list(command), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    self._procs.append(proc)
    assert proc.stdout is not None
    pump = threading.Thread(target=self.output.pump, args=(index, proc.stdout),
                            daemon=True, name=f'multihost-launch-pump-{index}')
    reap = threading.Thread(target=self._reap, args=(index, proc),
                            daemon=True, name=f'multihost-launch-reap-{index}')
    for t in (pump, reap):
      t.start()
      self._threads.append(t)
    self._pumps.append(pump)

  @property
  def started(self) -> int:
    return len(self._procs)

  @property
  def pids(self) -> list[int]:
    return [p.pid for p in self._procs]

  # Observing. `*_locked` methods are for callers that hold `changed`.

  def returncodes_locked(self) -> list[int | None]:
    return list(self._returncodes)

  def end_times_locked(self) -> list[float | None]:
    """Per process, seconds from the start to its exit (or None)."""
    return [None if t is None else t - self.start_time for t in self._ended]

  def line_times_locked(self) -> tuple[tuple[float, ...], ...]:
    """Per process, per captured line, seconds from the start to when it was read."""
    return tuple(tuple(t - self.start_time for t in self.output.times_locked(i))
                 for i in range(self.num_processes))

  def stopped_locked(self) -> frozenset[int]:
    return frozenset(self._stopped)

  def returncodes(self) -> list[int | None]:
    """Per process: None while running, else as `subprocess` reports it."""
    with self.changed:
      return self.returncodes_locked()

  def running(self) -> list[int]:
    """Indices of the processes that have not exited."""
    with self.changed:
      return [i for i, rc in enumerate(self._returncodes) if rc is None]

  def output_ended_locked(self, index: int) -> bool:
    """Whether process `index` exited and its output was read to the end."""
    return (self._returncodes[index] is not None and
            not self._pumps[index].is_alive())

  def wait_for_output(self, index: int, text: str, *,
                      timeout: float) -> bool:
    """Waits until process `index` prints `text`; False on timeout or exit."""
    deadline = time.monotonic() + timeout
    with self.changed:
      while True:
        if text in self.output.text_locked(index):
          return True
        if self.output_ended_locked(index):
          return False
        left = deadline - time.monotonic()
        if left <= 0:
          return False
        self.changed.wait(min(left, 0.5))

  # Signalling and stopping.

  def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
    """Sends `sig` to process `index` (its pid only) if it is running."""
    proc = self._procs[index]
    if proc.returncode is None:
      try:
        os.kill(proc.pid, sig)
      except ProcessLookupError:
        pass

  def signal_running(self, sig: int) -> None:
    """Sends `sig` to every running process's group and counts them as stopped by the launcher.

    A process that has exited but that its reaper thread has not recorded
    yet is not counted as stopped: it ended by itself (e.g. aborted just
    after another's failure, which the report must see as its own exit).
    """
    for i, proc in enumerate(self._procs):
      with self.changed:
        if self._returncodes[i] is not None:
          continue
        self._mark_stopped_locked(i, proc)
      signal_group(proc, sig)

  def _mark_stopped_locked(self, i: int, proc: subprocess.Popen) -> None:
    """Counts process `i` as stopped by the launcher, unless it has already exited by itself (not yet reaped); hold `changed`."""
    if not exited(proc.pid):
      self._stopped.add(i)

  def stop(self, *, wait: float,
           until: collections.abc.Callable[[], bool] | None = None) -> None:
    """Waits up to `wait` seconds (or until `until()`) for running processes, SIGKILLs the rest, reaps all."""
    deadline = time.monotonic() + wait
    with self.changed:
      while (any(rc is None for rc in self._returncodes[:len(self._procs)])
             and time.monotonic() < deadline
             and not (until is not None and until())):
        self.changed.wait(max(0.0, min(0.1, deadline - time.monotonic())))
    for i, proc in enumerate(self._procs):
      if proc.returncode is None and self._returncodes[i] is None:
        with self.changed:
          self._mark_stopped_locked(i, proc)
        signal_group(proc, signal.SIGKILL)
    for proc in self._procs:
      try:
        proc.wait(timeout=10)
      except subprocess.TimeoutExpired:  # Unkillable (D state); report it.
        pass
    _reaper.collect([proc.pid for proc in self._procs])
    for t in self._threads:
      t.join(timeout=5)

  def _reap(self, index: int, proc: subprocess.Popen[bytes]) -> None:
    returncode = proc.wait()
    with self.changed:
      self._returncodes[index] = returncode
      self._ended[index] = time.monotonic()
      self.changed.notify_all()
