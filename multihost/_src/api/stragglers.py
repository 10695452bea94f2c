"""Public collective: straggler_report, who came last to the recent collectives and by how much."""

from __future__ import annotations

import dataclasses

from multihost._src.api import gather
from multihost._src.runtime import runtime

# at least _MIN_CALLS compared collectives.
_SHARE = 0.75
_MIN_CALLS = 8
# The straggler's skew matters when it is at least this share of a step and
# at least _FLOOR_S: below, it is scheduling noise, not a slow process.
_STEP_SHARE = 0.05
_FLOOR_S = 0.005


@dataclasses.dataclass(frozen=True)
class StragglerReport:
  """Who came last to the recent collectives (up to the last 64 every process recorded).

  Every process leaves a collective's meeting at about the same moment, so
  the one that waited least arrived last; a call's skew is the longest wait
  minus the shortest (how long the first arrival waited for the last).

  Attributes:
    calls: collectives compared.
    last_counts: per process, how many of them it came last to.
    skew_when_last: per process, its mean skew (seconds) over those.
    mean_skew: mean skew over all compared calls, seconds.
    max_skew: largest skew, seconds.
    consistently_last: the process that came last to at least 3/4 of at
      least 8 compared calls, else None.
  """
  calls: int
  last_counts: tuple[int, ...]
  skew_when_last: tuple[float, ...]
  mean_skew: float
  max_skew: float
  consistently_last: int | None

  @classmethod
  def from_waits(cls, everyone: list[dict[int, float]]) -> StragglerReport:
    """The report from every process's {call number: seconds it waited}, in process order."""
    count = len(everyone)
    common = set(everyone[0])
    for waits in everyone[1:]:
      common &= set(waits)
    last_counts = [0] * count
    skew_sums = [0.0] * count
    skews = []
    for call in sorted(common):
      row = [w[call] for w in everyone]
      last = min(range(count), key=row.__getitem__)
      skew = max(row) - row[last]
      last_counts[last] += 1
      skew_sums[last] += skew
      skews.append(skew)
    calls = len(skews)
    consistent = None
    if calls >= _MIN_CALLS and count > 1:
      top = max(range(count), key=last_counts.__getitem__)
      if last_counts[top] >= _SHARE * calls:
        consistent = top
    return cls(
        calls=calls, last_counts=tuple(last_counts),
        skew_when_last=tuple(s / n if n else 0.0
                             for s, n in zip(skew_sums, last_counts)),
        mean_skew=sum(skews) / calls if calls else 0.0,
        max_skew=max(skews, default=0.0), consistently_last=consistent)

  def matters(self, *, step_seconds: float) -> bool:
    """Whether a consistent straggler costs a noticeable share of a step (worth a log line).

    True when a process came last consistently and by, on average, at least
    5% of `step_seconds` and at least 5 ms: sub-millisecond skews are
    scheduling noise, and a fixed few ms matter only to short steps.

    Args:
      step_seconds: the training step's duration (e.g. its median).
    """
    p = self.consistently_last
    if p is None:
      return False
    return self.skew_when_last[p] >= max(_FLOOR_S,
                                         _STEP_SHARE * step_seconds)

  def summary(self) -> str:
    """One line: the consistent straggler and by how much, or that there is none."""
    if self.consistently_last is not None:
      p = self.consistently_last
      return (f'straggler: process {p} came last to {self.last_counts[p]} '
              f'of the last {self.calls} collectives, '
              f'{self.skew_when_last[p] * 1e3:.1f} ms after the first on '
              f'average (max skew {self.max_skew * 1e3:.1f} ms)')
    return (f'no consistent straggler over the last {self.calls} collectives '
            f'(mean skew {self.mean_skew * 1e3:.1f} ms, max '
            f'{self.max_skew * 1e3:.1f} ms)')


def straggler_report(*, timeout: float | None = None) -> StragglerReport:
  """Who came last to the recent collectives, and by how much (see `StragglerReport`).

  Collective: every process must call this, in the same order.

  Each process keeps, for its last 64 collectives, how long it waited for
  the others (two clock reads per call); this gathers those waits and
  compares the calls every process recorded. Every process gets the same
  report.

  Args:
    timeout: seconds to wait for every process.

  Raises:
    CollectiveTimeoutError: a process did not arrive in time (named).
  """
  waits = runtime.current().flight.waits()
  everyone = gather.allgather_object(waits, timeout=timeout)
  return StragglerReport.from_waits(everyone)
