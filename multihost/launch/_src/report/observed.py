"""What the launcher saw of a finished run (`Observed`, the input of `_report.report`), and how one process ended, in words."""

from __future__ import annotations

import dataclasses
import signal

from multihost.launch._src.report import evidence as _evidence

# Process 0's death is still blamed when the JAX runtime's aborts of the
# others were seen up to this many seconds before it (the reaper threads
# observe exits in no particular order).
ABORT_RACE_S = 0.5


def status_of(returncode: int) -> int:
  """Shell-style exit status: the code, or 128+N for death by signal N."""
  return 128 - returncode if returncode < 0 else returncode


def signal_name(signum: int) -> str:
  """'SIGKILL' for 9; 'signal N' for a number that names no signal."""
  try:
    return signal.Signals(signum).name
  except ValueError:
    return f'signal {signum}'


def describe(returncode: int | None) -> str:
  """'exit status 1', 'killed by SIGKILL (status 137)' or 'still running'."""
  if returncode is None:
    return 'still running'
  if returncode < 0:
    return f'killed by {signal_name(-returncode)} (status {128 - returncode})'
  return f'exit status {returncode}'


@dataclasses.dataclass(frozen=True)
class Observed:
  """What the launcher saw of a finished run: the input of `report()`.

  Attributes:
    returncodes: per process, as `subprocess` reports them (negative: killed
      by that signal); None if it could not be reaped.
    end_times: per process, seconds from the start to its exit (or None).
    stopped: the processes the launcher stopped (they did not fail alone).
    pids: per process, its pid.
    outputs: per process, its merged stdout and stderr.
    devices_per_process: CPU devices per controller (for the summary).
    elapsed: seconds the whole run took.
    grace_period: seconds the others got after the first failure.
    host_service: whether the launcher hosted the coordination service (then
      process 0 is an ordinary controller).
    timed_out: whether the timeout stopped the run.
    still_running_at_timeout: the processes running at the timeout.
    interrupted_by: the signal the launcher got and forwarded, or None.
    line_times: per process, per line of its output, seconds from the
      start to when the launcher read it (empty: not known; then the first
      failure is the first exit).
    hosts: None, or 'netns' when each process ran on a simulated host.
    host_addresses: with hosts, per process, its host's address.
    stopped_to_restart: the launcher stopped the others at the first
      failure, without a grace period, because a restart follows.
  """
  returncodes: tuple[int | None, ...]
  end_times: tuple[float | None, ...]
  stopped: frozenset[int] = frozenset()
  pids: tuple[int, ...] = ()
  outputs: tuple[str, ...] = ()
  devices_per_process: int = 1
  elapsed: float = 0.0
  grace_period: float = 0.0
  host_service: bool = False
  timed_out: bool = False
  still_running_at_timeout: tuple[int, ...] = ()
  interrupted_by: int | None = None
  line_times: tuple[tuple[float, ...], ...] = ()
  hosts: str | None = None
  host_addresses: tuple[str, ...] = ()
  stopped_to_restart: bool = False

  def lines(self, index: int) -> list[str]:
    """Process `index`'s output lines, without newlines (one per `line_times[index]`)."""
    if index >= len(self.outputs):
      return []
    return self.outputs[index].split('\n')[:-1]

  def raised(self) -> tuple[_evidence.Raised | None, ...]:
    """Per process, its first traceback (None: none, or no times known)."""
    return tuple(
        _evidence.first_raised(self.lines(i), self.line_times[i])
        if i < len(self.line_times) else None
        for i in range(len(self.returncodes)))
