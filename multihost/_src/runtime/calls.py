"""Runtime: the numbering of collective calls, which keys their barriers and key-value entries.

Every process must call the collectives in the same order, so the same
number names the same call on every process. The counter is the runtime's
(`runtime.runtime.Runtime.next_call_id`); these are its seams for harnesses.
"""

from __future__ import annotations

from multihost._src.runtime import runtime


def next_call_id() -> int:
  """The number of the collective call about to start (0, 1, 2, ...)."""
  return runtime.current().next_call_id()


def reset(start: int) -> None:
  """Makes `start` the next call's number (every process must pass the same).

  For harnesses that realign processes after some of them left collectives
  unmatched (the pytest plugin does, between tests).
  """
  runtime.current().reset_calls(start)
