"""The agreement over the TCP links with real controllers (tests/programs/links_drill.py).

Every case first waits until the processes agree over the links, so what
follows runs there, not on the coordination service's barriers.
"""

from __future__ import annotations

import os
import re

from _helpers import mode_parts
from _helpers import program
import pytest

from multihost import env
from multihost import launch

# One run drills both cases in turn (each after the processes agree over
# the links again); a test reads its case's part of every output.
_MODES, _SLEEPERS = ('mismatch', 'skew', 'eager'), (1, 2, 1)


@pytest.fixture(scope='module')
def _drilled():
  with launch.Controllers(
      program('links_drill', ','.join(_MODES), ','.join(map(str, _SLEEPERS))),
      num_processes=3, env=dict(os.environ), grace_period=30) as cluster:
    return cluster.wait(timeout=90)


def _run(result, mode):
  """Every process's output of MODE's part, after checking the run."""
  assert result.ok, result.summary
  for out in result.outputs:
    assert 'PASSED' in out, out[-3000:]
  parts = mode_parts(result.outputs, mode)
  for part in parts:
    assert 'LINKS True' in part, part[-3000:]
  return parts


def test_a_mismatch_over_the_links_raises_on_every_process(_drilled):
  for p, out in enumerate(_run(_drilled, 'mismatch')):
    m = re.search(r'RAISED ConsistencyError (.*)', out)
    assert m, out[-3000:]
    assert m.group(1).startswith(f'[process={p}] sync_global_devices name '
                                 'mismatch'), m.group(1)
    assert "'odd'" in m.group(1) and "'even'" in m.group(1), m.group(1)
    assert 'AFTER ok [0, 1, 2]' in out, out[-3000:]


def test_a_timeout_over_the_links_names_the_late_process_and_all_go_on(
    _drilled):
  for i, out in enumerate(_run(_drilled, 'skew')):
    m = re.search(r'STEP 0 timeout after=([\d.]+) missing=\[(\d)\] '
                  r'message=(.*)', out)
    assert m, out[-3000:]
    after = float(m.group(1))
    if i == 2:  # the late one: at once, saying how late
      assert after < 1.0, m.group(0)
      assert 'arrived late' in m.group(3), m.group(3)
    else:
      assert 6.0 <= after < 6.0 + 1.5, m.group(0)
      assert 'waiting for process(es) [2] to arrive' in m.group(3)
      assert 'Where they are: process 2:' in m.group(3), m.group(3)
    assert m.group(2) == '2', m.group(0)
    for step in (1, 2):  # back in step: stale frames were not taken
      assert f'STEP {step} ok [0, 1, 2]' in out, (i, out[-3000:])


@pytest.fixture(scope='module')
def _drilled_over_tcp():
  """The eager drill at 2 processes with local links off (MULTIHOST_LOCAL_LINKS=0).

  With no shared-memory stage on this host, the 8 and 64 MiB broadcasts
  move over TCP as between hosts, and at 2 processes (no star) the source
  sends its first stripe before it hears from its peer: more than its
  socket takes, so a difference or a timeout leaves its link owing the
  rest (`tcp.eager.Eager.defer`), which the next call must deliver.
  """
  with launch.Controllers(
      program('links_drill', 'eager', '1'), num_processes=2,
      env={**os.environ, env.LOCAL_LINKS: '0'}, grace_period=30) as cluster:
    return cluster.wait(timeout=90)


@pytest.mark.parametrize('links', ['local', 'tcp'])
def test_a_broadcast_sent_during_its_agreement_is_dropped_on_a_mismatch(
    request, links):
  # The source's first stripe goes out with its agreement frame; on a
  # difference its link owes the rest and the next process drops it, so
  # the links stay open and in step: the next broadcast is correct, on the
  # same links (no reconnection). Over TCP (no stage) the stripe of the
  # large broadcasts is more than the socket takes: the rest must follow.
  drilled = request.getfixturevalue(
      '_drilled' if links == 'local' else '_drilled_over_tcp')
  for p, out in enumerate(_run(drilled, 'eager')):
    for n in (1 << 18, 2 << 20, 16 << 20):
      for case in ('shape', 'sources'):
        m = re.search(rf'EAGER {n} {case} RAISED (.*)', out)
        assert m, out[-3000:]
        assert m.group(1).startswith(f'[process={p}] broadcast_one_to_all'), (
            m.group(1))
      # Process 1 passes is_source=False, process 0 the default: the
      # digests differ, the headers agree, and the stripe sent early is
      # the transfer's (its rest is sent, not the whole again).
      assert f'EAGER {n} source not raised' in out, out[-3000:]
      assert f'EAGER {n} SAME LINKS True' in out, out[-3000:]
    # A source that sent ahead and then timed out leaves its link owing the
    # rest of the frame; the late process raises, drops the frame, and all
    # go on.
    assert re.search(r'EAGER LATE 0 (CollectiveTimeoutError|'
                     r'ProcessFailureError|MultihostError)', out), out[-3000:]
    for i in (1, 2):
      assert f'EAGER LATE {i} ok' in out, out[-3000:]


@pytest.mark.parametrize('count', [3, 2])
def test_a_source_that_gave_up_after_sending_early_fails_every_process(count):
  # tests/programs/eager_gave_up.py: the source of a default-source
  # broadcast sends its first stripe during the agreement, then times out
  # on its last round while a latecomer (that did not yet see its gave-up
  # mark) lets every other process complete the agreement. The payload is
  # on their sockets, but no process may return it unless the source does:
  # the call's outcome record (settled by the source at its deadline, read
  # by each process that completes late) makes every process raise, and
  # the calls after it return everywhere.
  with launch.Controllers(program('eager_gave_up', 1), num_processes=count,
                          env=dict(os.environ), grace_period=30) as cluster:
    result = cluster.wait(timeout=120)
  for n in (1 << 18, 4 << 20):
    outcomes = _all_or_none(result, n)
    assert outcomes[0].startswith('CollectiveTimeoutError'), outcomes[0]
    for p, outcome in enumerate(outcomes[1:], 1):
      assert outcome.startswith(
          f'CollectiveTimeoutError [process={p}] broadcast_one_to_all'), (
              n, p, outcome)


def _all_or_none(result, case) -> list[str]:
  """Each process's outcome of call 0 of `case` (a program's `CALL <case> <i> <outcome>` lines), checked: none returned, calls 1 and 2 returned on every process, and the program passed."""
  first = [re.search(rf'CALL {case} 0 (.*)', out) for out in result.outputs]
  assert all(first), [out[-3000:] for out in result.outputs]
  outcomes = [m.group(1) for m in first]
  assert not any(o.startswith('ok') for o in outcomes), (case, outcomes)
  for out in result.outputs:  # back in step
    for i in (1, 2):
      assert f'CALL {case} {i} ok' in out, (case, i, out[-3000:])
  assert result.ok, result.summary
  for out in result.outputs:
    assert 'PASSED' in out and 'LINKS True' in out, out[-3000:]
  return outcomes


def test_a_process_that_gave_up_on_its_last_round_fails_every_process():
  # tests/programs/gave_up_last_round.py: process 1 times out on its last
  # agreement round after sending every frame the others need; process 0
  # completes the rounds after that deadline. All or none: both raise, and
  # the calls after it return on both. (At 3 processes the others, waiting
  # longer than the diagnosis window, already see process 1's gave-up mark.)
  with launch.Controllers(program('gave_up_last_round'), num_processes=2,
                          env=dict(os.environ), grace_period=30) as cluster:
    result = cluster.wait(timeout=120)
  for op in ('sync_global_devices', 'broadcast_one_to_all',
             'process_allgather'):
    outcomes = _all_or_none(result, op)
    assert all(o.startswith('CollectiveTimeoutError') for o in outcomes), (
        op, outcomes)
