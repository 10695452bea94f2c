"""Control plane: who sends the agreement's frames to whom over the links: the dissemination rounds, or on one host a star at process 0, whose answers may take a broadcast tree's path.

`control.rounds` runs the agreement; this module only names, for each
process, the peers of each of its steps, the same on every process from
the same inputs (the process count, whether the job agrees in a star, and
in a star what each process said in its frame to process 0).
"""

from __future__ import annotations

import os

from multihost._src.runtime import runtime
from multihost._src.transport.tcp import tree

# Processes on one host agree in a star at process 0 when there are this
# many and at least as many as the host's cores (`star`): 2(P-1)
# messages a call instead of P log2 P, where every message costs CPU that
# the processes share, and a hop on one host is cheap. Between hosts, or
# with a core per process, the dissemination rounds' latency (log2 P
# hops, no process handling more than one message a round) wins (16
# cores, P=4: a barrier 93-126 us in the star, 63-70 in the rounds), and
# at 2 processes they take one hop where a star takes two.
STAR_MIN, STAR_MAX = 3, 8


def steps(me: int, count: int, star: bool,
          relayed: bool = False) -> list[tuple[int | None, int | None]]:
  """(send to, receive from) of each step of the agreement; either may be None.

  The dissemination rounds, or with `star` the star at process 0: every
  other process sends to it, and receives its answer from it, or with
  `relayed` from its parent in the tree (`answered_by`); process 0
  receives from each in turn. Who gets an answer from whom follows from
  what process 0 received (`answers`).
  """
  if star:
    if me == 0:
      return [(None, p) for p in range(1, count)]
    return [(0, None), (None, answered_by(me, count, relayed))]
  rounds: list[tuple[int | None, int | None]] = []
  step = 1
  while step < count:
    rounds.append(((me + step) % count, (me - step) % count))
    step *= 2
  return rounds


def answered_by(me: int, count: int, relayed: bool) -> int:
  """The process this one (not 0) takes its answer from in a star: with `relayed`, its parent in the binomial tree rooted at process 0 (`tcp.tree.tree_peers`), else process 0."""
  if not relayed:
    return 0
  parent = tree.tree_peers(me, count)[0]
  if parent is None:
    raise ValueError(f'process {me} of {count} takes no answer: it is the '
                     'root of the tree.')
  return parent


def answers(me: int, count: int, relays: int,
            first: int | None = None) -> list[int]:
  """The processes this one answers in a star, once it has its answer: `relays` are those that take it from their parent (bit p for process p).

  Process 0 answers every other process that does not, and its own
  children, `first` (a broadcast source's first peer,
  `tcp.chain.first_peer`) first; any other process passes the answer on
  to its children that take it from it.
  """
  if me:
    return [c for c in tree.tree_peers(me, count)[1] if relays >> c & 1]
  order = [p for p in range(1, count)
           if not relays >> p & 1 or tree.tree_peers(p, count)[0] == 0]
  if first in order:
    order = [first, *(p for p in order if p != first)]
  return order


def star(rt: runtime.Runtime, hosts: list[str] | None) -> bool:
  """Whether calls agree in a star: STAR_MIN to STAR_MAX processes, all on one host, with no more cores than processes (the same answer on every process: from the same records, and one host's core count)."""
  return (hosts is not None and STAR_MIN <= rt.count <= STAR_MAX
          and len(set(hosts)) == 1 and host_cores() <= rt.count)


def host_cores() -> int:
  """The host's cores: the same on every process of one host (not `threads.cores`, this process's affinity, which may differ by process)."""
  return os.cpu_count() or 1
