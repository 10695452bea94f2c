"""The striped broadcast's lanes (`transport.tcp.chain.broadcast`), on an in-memory coordination service.

Threads stand for processes, each with its own runtime on one
`fake_coordination.FakeService` and its own plane: real authenticated TCP
links on loopback, real lane threads. `chain.broadcast` finds its
process's runtime through `runtime.current()`, which is process-wide; here
each thread sees its own. The multi-process tests of the same transfers are
in test_transport.py and test_failures.py.
"""

from __future__ import annotations

import threading
import types

import fake_coordination as fake
import numpy as np
import pytest

from multihost import env as env_lib
from multihost._src.auth import secret
from multihost._src.control import topology
from multihost._src.runtime import errors
from multihost._src.runtime import runtime
from multihost._src.transport.tcp import chain
from multihost._src.transport.tcp import payload
from multihost._src.transport.tcp import tree

# Two stripes: lane 0's on the calling thread, lane 1's on the plane's lane
# thread.
LENGTH = 2 * payload.STRIPE_BYTES


@pytest.fixture
def job(monkeypatch):
  """(runtimes, bind) of 2 processes on two lanes; `bind(rt)` makes `rt` the calling thread's runtime."""
  monkeypatch.setattr(secret, '_TAKEN', {})
  monkeypatch.delenv(env_lib.JOB_SECRET, raising=False)
  monkeypatch.delenv(env_lib.JOB_SECRET_FILE, raising=False)
  monkeypatch.setenv(env_lib.TCP_LANES, '2')
  local = threading.local()
  process_wide = runtime.current
  monkeypatch.setattr(runtime, 'current',
                      lambda: getattr(local, 'rt', None) or process_wide())
  _, rts = fake.runtimes(2)
  for rt in rts:  # As multihost.initialize() does (see test_control_links).
    rt.settings.exit_on_peer_failure = (False, None, None)
    rt.watchdog.start(heartbeat_timeout=2)

  def bind(rt):
    local.rt = rt

  yield rts, bind
  for rt in rts:
    rt.watchdog.cancel_peer_loss()
  fake.stop(rts)


def test_a_failed_lane_past_the_first_fails_the_broadcast_on_every_process(
    job):
  """A broadcast whose lane 1 fails while lane 0 completes raises on every process; none returns the partly filled result."""
  rts, bind = job
  data = np.arange(LENGTH, dtype=np.uint8)
  assert len(payload.stripes(LENGTH, 2)) == 2

  def broadcast(rt, timeout):
    bind(rt)
    parts = [data] if rt.index == 0 else None
    out = chain.broadcast(parts, LENGTH, 0, op='broadcast_one_to_all',
                              timeout=timeout)
    return bytes(out)

  # Both lanes' links are set up, and a whole broadcast arrives.
  results = fake.run(rts, lambda rt: broadcast(rt, 20.0))
  assert [out for out, _ in results] == [data.tobytes()] * 2, results

  # Process 0's lane thread is busy: its lane 1 never sends, so process 1's
  # lane 1 reads nothing until the deadline. Lane 0 moves its stripe on both.
  release = threading.Event()
  rts[0].plane.lane_threads[0].run(lambda: release.wait(30))
  timeout = 2.0
  try:
    results = fake.run(rts, lambda rt: broadcast(rt, timeout))
  finally:
    release.set()
  returned = [p for p, (out, _) in enumerate(results)
              if not isinstance(out, errors.MultihostError)]
  assert not returned, (
      f'processes {returned} returned (lane 1 failed, lane 0 completed): '
      f'{[(type(out).__name__, round(s, 1)) for out, s in results]}')
  for p, (out, seconds) in enumerate(results):  # lane 1's failure
    assert seconds >= timeout - 0.1, (p, seconds, out)


@pytest.mark.parametrize('count', [3, 4, 5, 7, 8, 9, 16])
def test_a_one_stripe_broadcast_tree_reaches_every_process_once_in_log2_p_hops(
    count):
  # Below STRIPE_BYTES, at 3 processes or more, a broadcast goes down a
  # binomial tree rooted at the source (`tree.tree_peers`, relative ranks).
  parents, depth = {}, {0: 0}
  for rank in range(count):
    parent, children = tree.tree_peers(rank, count)
    assert (parent is None) == (rank == 0)
    for child in children:
      assert child not in parents, (child, rank)  # one parent each
      parents[child] = rank
      assert tree.tree_peers(child, count)[0] == rank
  assert sorted(parents) == list(range(1, count))
  for rank in sorted(parents):  # (a parent's rank is below its children's)
    depth[rank] = depth[parents[rank]] + 1
  # Each hop sets one bit of the rank: depth = the most bits of a rank,
  # at most ceil(log2 P) (where the chain takes P - 1 hops).
  assert max(depth.values()) == max(bin(r).count('1') for r in range(count))
  assert max(depth.values()) <= (count - 1).bit_length()
  # The root sends to its largest subtree first.
  assert tree.tree_peers(0, count)[1] == sorted(
      tree.tree_peers(0, count)[1], reverse=True)


@pytest.mark.parametrize('count,length,lanes,first', [
    (2, 1 << 20, 2, 1),  # two processes: no tree, the next one
    (3, 1 << 20, 2, 2),  # down the tree: its first child, the largest
    (5, 1 << 20, 2, 4),  # subtree's root
    (8, 1 << 20, 2, 4),
    (9, 1 << 20, 2, 8),
    (5, payload.STRIPE_BYTES, 2, 1),  # striped, down the chains
    (5, payload.STRIPE_BYTES, 1, 1),  # one lane: a chain all the same
])
def test_the_early_stripe_goes_to_the_peer_the_transfer_sends_to_first(
    count, length, lanes, first):
  """A broadcast source's early stripe (`tcp.eager.Eager`) goes to the process its transfer sends to first (the tree's largest subtree, or the chain's next process), and in a star that process is answered first."""
  me = 2
  plane = types.SimpleNamespace(me=me, count=count, lanes=lanes)
  assert chain.first_peer(plane, length) == (me + first) % count
  assert tree.carries(count, length) == (count > 2 and length
                                         < payload.STRIPE_BYTES)
  if count <= topology.STAR_MAX:  # The star's center answers it first.
    answers = topology.answers(0, count, 0, first)
    assert answers == [first] + [p for p in range(1, count) if p != first]
    # Also where every other process takes its answer from its parent in
    # the tree (a relayed broadcast's), then only the center's children.
    relayed = topology.answers(0, count, (1 << count) - 2, first)
    assert relayed[0] == first
    assert sorted(relayed) == sorted(tree.tree_peers(0, count)[1])
  else:  # The rounds send to it in one of theirs.
    assert (me + first) % count in [
        dst for dst, _ in topology.steps(me, count, False)]
