"""The agreement over the TCP links (`control.links`, `control.rounds`), on an in-memory coordination service.

Threads stand for processes, each with its own runtime on one
`fake_coordination.FakeService` and its own plane: real authenticated TCP
links on loopback. The first calls meet through the service while the links
are set up (as in a real job); the calls after them agree over the links. The
real-process tests of the same paths are in test_failures.py and
test_collectives.py (which run on the links by default).
"""

from __future__ import annotations

import re
import socket
import threading
import time
import types

import fake_coordination as fake
import numpy as np
import pytest

from multihost._src.control import agree
from multihost._src.control import links
from multihost._src.control import topology
from multihost._src.runtime import errors
from multihost._src.runtime import leaves
from multihost._src.transport.tcp import eager as _eager
from multihost._src.transport.tcp import frames
from multihost._src.transport.tcp import link as _tcp_link
from multihost._src.transport.tcp import sockets
from multihost._src.transport.tcp import tree

Header = agree.Header


def _sync(rt, name='x', timeout=10.0):
  return agree.agree(Header('sync_global_devices', name=name),
                              timeout=timeout, runtime=rt)


def _started(count):
  service, rts = fake.runtimes(count, links=True)
  for rt in rts:  # As multihost.initialize() does (see test_control_fake).
    rt.settings.exit_on_peer_failure = (False, None, None)
    rt.watchdog.start(heartbeat_timeout=2)
    rt.where.ensure_started()
  return service, rts


@pytest.fixture(params=['star', 'rounds'])
def shape(request, monkeypatch):
  """Each test twice: the processes (all on this host) agree in a star at process 0 from 3 processes on, as on one host with fewer cores than processes; or in the dissemination rounds, as between hosts."""
  if request.param == 'rounds':
    monkeypatch.setattr(topology, 'STAR_MIN', 1 << 30)
  else:
    monkeypatch.setattr(topology, 'host_cores', lambda: 1)
  return request.param


@pytest.fixture
def job(request, shape):
  """(service, runtimes) of `request.param` processes (3 by default), links set up."""
  count = getattr(request, 'param', 3)
  service, rts = _started(count)
  # Through the service until every process switched: bounded by the links'
  # setup time, not a number of calls (each takes about a millisecond, the
  # setup thread's connections 2-9 calls here, and more on a loaded machine).
  deadline = time.monotonic() + links.SETUP_S
  while time.monotonic() < deadline:
    first = fake.run(rts, _sync)
    assert [out for out, _ in first] == [
        agree.Agreement(True)] * count
    if any(links.usable(rt) for rt in rts):
      break
    time.sleep(0.001)
  assert all(links.usable(rt) for rt in rts)  # all in one call
  star = shape == 'star' and count >= 3
  assert [rt.plane.star for rt in rts] == [star] * count
  yield service, rts
  for rt in rts:
    rt.watchdog.cancel_peer_loss()
  fake.stop(rts)


def _errors_of(results, kind):
  for i, (out, _) in enumerate(results):
    assert isinstance(out, kind), f'process {i}: {out!r}'
  return [out for out, _ in results]


@pytest.mark.parametrize('job', [2, 3, 5], indirect=True)
def test_calls_agree_and_gather_over_the_links_without_the_service(job):
  service, rts = job
  count = len(rts)
  waits = []
  for rt in rts:  # Any barrier from now on would be the service's path.
    wait = rt.client.wait_at_barrier
    rt.client.wait_at_barrier = (
        lambda *a, wait=wait, **k: (waits.append(a[0]), wait(*a, **k)))
  for _ in range(3):
    results = fake.run(rts, lambda rt: agree.agree_and_gather(
        Header('process_allgather'), publish=b'row %d' % rt.index,
        timeout=10, runtime=rt))
    rows = [b'row %d' % p for p in range(count)]
    assert [out for out, _ in results] == [(rows, None)] * count
    results = fake.run(rts, lambda rt: agree.agree_and_read_one(
        Header('broadcast_one_to_all', payload=b'8 bytes!' if rt.index == 0
               else None), 0, timeout=10, runtime=rt))
    assert [out for out, _ in results] == [(b'8 bytes!', None)] * count
  assert all(seconds < 0.5 for _, seconds in results)
  assert waits == []
  del service


@pytest.mark.parametrize('job', [2, 3, 6], indirect=True)
def test_one_differing_process_makes_every_process_fall_back(job):
  _, rts = job
  for odd in range(len(rts)):
    results = fake.run(rts, lambda rt, odd=odd: _sync(
        rt, name='y' if rt.index == odd else 'x'))
    for out, _ in results:
      assert not out.agreed  # every process: the full exchange
      assert [h.name for h in out.headers] == [
          'y' if p == odd else 'x' for p in range(len(rts))]
  # And on agreement again, the links again.
  results = fake.run(rts, _sync)
  assert [out for out, _ in results] == [agree.Agreement(True)] * len(
      rts)


@pytest.mark.parametrize('job', [2], indirect=True)
def test_a_disagreement_raises_consistency_error_on_every_process(job):
  _, rts = job

  def call(rt):
    spec = leaves.LeafSpec((2 + rt.index,), 'float32')
    header = Header('process_allgather', tree='PyTreeDef(*)', paths=('',),
                    specs=(spec,))
    outcome = agree.agree(header, timeout=10, runtime=rt)
    agree.check_same_leaves(outcome.headers, me=rt.index)

  results = fake.run(rts, call)
  for p, e in enumerate(_errors_of(results, errors.ConsistencyError)):
    assert str(e).startswith(f'[process={p}] process_allgather: the inputs '
                             'differ across processes (processes [1] differ '
                             'from the rest)')


def test_a_timeout_names_the_missing_process_and_where_it_is(job):
  _, rts = job

  def call(rt):
    if rt.index == 2:
      return 'stays away'
    return _sync(rt, timeout=2.5)

  results = fake.run(rts, call)
  for p, e in enumerate(_errors_of(results[:2],
                                   errors.CollectiveTimeoutError)):
    assert list(e.missing) == [2]
    assert str(e).startswith(f'[process={p}] sync_global_devices: timed out')
    assert 'waiting for process(es) [2] to arrive' in str(e)
    assert 'Where they are: process 2: main thread in' in str(e)
  for _, seconds in results[:2]:
    assert 2.5 <= seconds < 2.5 + 1.0


def test_a_slow_peer_costs_no_window_and_no_fallback(job):
  _, rts = job
  results = fake.run(rts, _sync, delays={1: 1.5})
  assert [out for out, _ in results] == [agree.Agreement(True)] * 3
  assert results[0][1] < 1.5 + 0.5  # it waited for process 1, no more
  assert all(rt.backoff == 0 for rt in rts)


def test_a_late_process_is_told_and_its_stale_frames_are_discarded(job):
  _, rts = job
  results = fake.run(rts, lambda rt: _sync(rt, timeout=2), delays={2: 3.0})
  early = _errors_of(results[:2], errors.CollectiveTimeoutError)
  assert [list(e.missing) for e in early] == [[2], [2]]
  late, seconds = results[2]
  assert isinstance(late, errors.CollectiveTimeoutError), late
  assert str(late).startswith('[process=2] sync_global_devices: this process '
                              'arrived late')
  m = re.search(r'it got there ([\d.]+) s after them', str(late))
  assert m and 2.9 <= float(m.group(1)) < 3.5, str(late)
  assert seconds < 0.8  # at once, not after its own timeout
  # Everyone is in step again: frames left of the abandoned call (process
  # 2's, sent before it read the marks) are not taken for this one's.
  results = fake.run(rts, lambda rt: agree.agree_and_gather(
      Header('process_allgather'), publish=b'%d' % rt.index, timeout=5,
      runtime=rt))
  assert [out for out, _ in results] == [([b'0', b'1', b'2'], None)] * 3


@pytest.mark.parametrize('job', [2], indirect=True)
def test_a_forged_frame_is_refused(job):
  _, rts = job
  # Someone on the path writes a frame header process 1 did not MAC.
  link = rts[0].plane.conns[1]
  link.sock.sendall(bytes(frames.FRAME_SIZE))
  results = fake.run(rts, lambda rt: _sync(rt, timeout=3))
  forged = results[1][0]
  assert isinstance(forged, errors.MultihostError), forged
  assert str(forged).startswith('[process=')
  assert 'from process 0 failed authentication' in str(forged)
  # The links were closed; the next call opens new ones and agrees.
  results = fake.run(rts, _sync)
  assert [out for out, _ in results] == [agree.Agreement(True)] * 2


@pytest.mark.parametrize('job', [2], indirect=True)
def test_a_replayed_frame_is_refused(job):
  _, rts = job
  link = rts[0].plane.conns[1]
  sent = []
  sendall = link.sock.sendall

  class Recording:  # the socket, recording what process 0 sends
    def __getattr__(self, name):
      return getattr(sock, name)

    def send(self, data):
      sent.append(bytes(data))
      return sock.send(data)

  sock = link.sock
  link.sock = Recording()
  fake.run(rts, _sync)
  link.sock = sock
  sendall(sent[0])  # the first call's frame again
  results = fake.run(rts, lambda rt: _sync(rt, timeout=3))
  replayed = results[1][0]
  assert isinstance(replayed, errors.MultihostError), replayed
  assert 'a replayed or reordered frame' in str(replayed)


def test_the_links_are_kept_across_calls_and_nothing_grows(job):
  _, rts = job
  fake.run(rts, _sync)
  threads = threading.active_count()
  for _ in range(50):
    fake.run(rts, _sync)
  assert threading.active_count() <= threads
  # One link per peer of the agreement: at 3 processes both others in the
  # rounds; in a star, process 0 to each other, each other to process 0.
  want = [2, 1, 1] if rts[0].plane.star else [2, 2, 2]
  assert [len(rt.plane.conns) for rt in rts] == want


def test_where_a_link_cannot_be_set_up_every_process_stays_on_the_service():
  service, rts = _started(2)
  try:
    # As the first call would (the job keys are agreed by all processes).
    fake.run(rts, lambda rt: _tcp_link.plane_of(rt, 'test',
                                                time.monotonic() + 5))
    for listener in (rts[1].plane.listener, rts[1].plane.local_listener):
      listener.shutdown(socket.SHUT_RDWR)  # refuses connections
      listener.close()
    deadline = time.monotonic() + links.SETUP_S
    while time.monotonic() < deadline and not all(
        rt.plane.refused for rt in rts):
      results = fake.run(rts, _sync)
      assert [out for out, _ in results] == [agree.Agreement(True)] * 2
      time.sleep(0.01)
    for _ in range(3):  # and they stay there
      results = fake.run(rts, _sync)
      assert [out for out, _ in results] == [agree.Agreement(True)] * 2
    assert [rt.plane.refused for rt in rts] == [True, True]
    assert not any(links.usable(rt) for rt in rts)
  finally:
    for rt in rts:
      rt.watchdog.cancel_peer_loss()
    fake.stop(rts)
  del service


def _hold_agreement_frames(monkeypatch, process: int, seconds: float, *,
                           on_a_thread: bool):
  """Makes fake process `process` hold its agreement frames `seconds`: its send waits (or, `on_a_thread`, returns at once and the frame leaves later)."""
  real = sockets.send_all

  def held(conn, view, deadline):
    if threading.current_thread().name != f'fake-process-{process}':
      return real(conn, view, deadline)
    if not on_a_thread:
      time.sleep(seconds)
      return real(conn, view, deadline)
    later = threading.Timer(seconds, real, args=(conn, bytes(view), deadline))
    later.daemon = True
    later.start()
    return None

  monkeypatch.setattr(sockets, 'send_all', held)


def _in_step_again(rts, monkeypatch):
  """With the frames no longer held, the next call agrees on every process."""
  monkeypatch.undo()
  results = fake.run(rts, _sync)
  assert [out for out, _ in results] == [agree.Agreement(True)] * len(rts)


@pytest.mark.parametrize('job', [2], indirect=True)
def test_a_process_that_completes_after_another_gave_up_raises_too(
    job, monkeypatch):
  # Process 0 (timeout 1 s) gives the call up while process 1's frame is
  # held; process 1 then sends it, receives process 0's frame sent long ago,
  # and completes the rounds: the call's outcome record makes it raise too.
  _, rts = job
  _hold_agreement_frames(monkeypatch, 1, 1.6, on_a_thread=False)
  results = fake.run(rts, lambda rt: _sync(
      rt, timeout=1.0 if rt.index == 0 else 30.0))
  first, second = _errors_of(results, errors.CollectiveTimeoutError)
  assert 'timed out' in str(first) and '[1]' in str(first), first
  assert 'process 0 gave this call up at its timeout' in str(second), second
  _in_step_again(rts, monkeypatch)


@pytest.mark.parametrize('job', [2], indirect=True)
def test_a_deadline_that_passes_after_another_completed_waits_for_the_frames(
    job, monkeypatch):
  # Process 1 comes 1.6 s late, completes at once (process 0's frame waits
  # in its socket) and settles the call as done; its own frame reaches
  # process 0 only 1 s later, after process 0's 2 s deadline. Process 0
  # follows the record: it waits on and returns too.
  _, rts = job
  _hold_agreement_frames(monkeypatch, 1, 1.0, on_a_thread=True)
  results = fake.run(rts, lambda rt: _sync(
      rt, timeout=2.0 if rt.index == 0 else 30.0), delays={1: 1.6})
  assert [out for out, _ in results] == [agree.Agreement(True)] * 2, results
  assert results[0][1] > 2.0, results  # past its deadline, then returned
  _in_step_again(rts, monkeypatch)


@pytest.mark.parametrize('job', [2], indirect=True)
def test_calls_spaced_within_their_timeout_leave_no_outcome_record(job):
  service, rts = job
  for _ in range(20):
    results = fake.run(rts, _sync)
    assert [out for out, _ in results] == [agree.Agreement(True)] * 2
  assert not [k for k in service.store if k.endswith('.outcome')], sorted(
      service.store)


def test_one_host_agrees_in_a_star_only_with_no_more_cores_than_processes(
    monkeypatch):
  rt = types.SimpleNamespace(count=4)
  monkeypatch.setattr(topology, 'host_cores', lambda: 4)
  assert topology.star(rt, ['h'] * 4)
  assert not topology.star(rt, ['a', 'b', 'a', 'b'])  # two hosts: rounds
  assert not topology.star(rt, None)  # hosts unread
  monkeypatch.setattr(topology, 'host_cores', lambda: 16)  # a core each: rounds
  assert not topology.star(rt, ['h'] * 4)
  assert not topology.star(types.SimpleNamespace(count=2), ['h'] * 2)


_BYTES = 1 << 20  # a default-source broadcast's payload that goes down the tree


def _tree_broadcast(rt, *, timeout=10.0, relayed=True, tree_='PyTreeDef(*)'):
  """A default-source broadcast of _BYTES as `broadcast_one_to_all` makes it over the links: the agreement (process 0's early stripe started in it, and with `relayed` every process's `tree.Relay`), then the tree.

  Returns (the agreement, the relay's `folded`, the bytes this process has).
  """
  op = 'broadcast_one_to_all'
  source = rt.index == 0
  data = (np.arange(_BYTES) % 251).astype(np.uint8)
  relay = tree.Relay() if relayed else None
  early = _eager.Eager([data], _BYTES) if source else None
  outcome = agree.agree(
      Header(op, tree=tree_, default_source=True, is_source=source,
             size=_BYTES), timeout=timeout, runtime=rt, eager=early,
      relay=relay)
  if not outcome.agreed:
    return outcome, None, None
  deadline = time.monotonic() + timeout
  plane = _tcp_link.get_plane(op, deadline, runtime=rt)
  out = None if source else np.zeros(_BYTES, np.uint8)
  early = early if early is not None and early.link else None
  tree.broadcast(plane, plane.seq, 0, _BYTES, [data] if source else None,
                 out, op, deadline, early, relay)
  if early is not None and early.copying is not None:
    early.copying.join(deadline)
  return outcome, relay and relay.folded, data if source else out


def _frames_sent(rt) -> int:
  return sum(link.sent for link in rt.plane.conns.values())


@pytest.mark.parametrize('job', [5, 8], indirect=True)
def test_a_relayed_broadcast_s_payload_frames_are_its_answers(job):
  """In a star, a default-source broadcast down the tree sends no answers: process 0 sends its children the payload alone, and each process reads its agreement from the payload's frame header."""
  _, rts = job
  count = len(rts)
  want = (np.arange(_BYTES) % 251).astype(np.uint8)
  for _ in range(3):
    before = _frames_sent(rts[0])
    results = fake.run(rts, _tree_broadcast)
    for p, (out, _) in enumerate(results):
      assert not isinstance(out, BaseException), f'process {p}: {out!r}'
      agreement, folded, got = out
      assert agreement.agreed
      np.testing.assert_array_equal(got, want, err_msg=f'process {p}')
      star = rts[0].plane.star
      assert folded == (_BYTES if star and p else None), (p, folded)
    children = tree.tree_peers(0, count)[1]
    # Process 0's frames: the payload to each child (in a star), or its
    # agreement rounds' and the payload's (log2 P rounds of the links).
    sent = _frames_sent(rts[0]) - before
    if rts[0].plane.star:
      assert sent == len(children), sent
    else:
      assert sent == len(topology.steps(0, count, False)) + len(children)


@pytest.mark.parametrize('job', [8], indirect=True)
@pytest.mark.parametrize('odd', [0, 4, 7])
def test_a_difference_in_a_relayed_broadcast_reaches_every_process(job, odd):
  """One process's call differs (here: no relay, another tree), at the tree's root, in its middle (4: parent of 5 and 6) or at a leaf: every process gets every header at once (no wait for an answer that is never sent), and the next call is in step."""
  _, rts = job
  results = fake.run(rts, lambda rt: _tree_broadcast(
      rt, relayed=rt.index != odd,
      tree_='PyTreeDef([*])' if rt.index == odd else 'PyTreeDef(*)'))
  for p, (out, seconds) in enumerate(results):
    assert not isinstance(out, BaseException), f'process {p}: {out!r}'
    agreement, _, _ = out
    assert not agreement.agreed, p
    assert [h.tree for h in agreement.headers] == [
        'PyTreeDef([*])' if q == odd else 'PyTreeDef(*)' for q in range(8)]
    assert seconds < 5, (p, seconds)
  results = fake.run(rts, _tree_broadcast)
  assert all(out[0].agreed for out, _ in results), results


@pytest.mark.parametrize('job', [8], indirect=True)
def test_a_relayed_broadcast_with_differing_timeouts_passes_the_answer_down(
    job):
  """Processes that give different timeouts must all learn the smallest (for the call's outcome record): process 0 answers, and the answer goes down the tree, before the payload."""
  _, rts = job
  results = fake.run(rts, lambda rt: _tree_broadcast(
      rt, timeout=9.0 if rt.index == 6 else 10.0))
  want = (np.arange(_BYTES) % 251).astype(np.uint8)
  for p, (out, _) in enumerate(results):
    assert not isinstance(out, BaseException), f'process {p}: {out!r}'
    agreement, folded, got = out
    assert agreement.agreed and folded is None, (p, folded)
    np.testing.assert_array_equal(got, want, err_msg=f'process {p}')


@pytest.mark.parametrize('job', [8], indirect=True)
@pytest.mark.parametrize('closed', [False, True])
def test_a_relayed_broadcast_names_a_missing_process(job, closed):
  """A process in the tree's middle stays away: every other process, its children too, raises the named timeout; also where the links were closed (as after a failed transfer), so that its children wait for it to connect."""
  _, rts = job
  if closed:
    for rt in rts:
      _tcp_link.break_plane(rt.plane, None)

  # (Long enough that every other process's thread starts its call well
  # within it on a loaded machine: with 2.5 s, under CI's load, process 1
  # once started late enough to be named as late itself.)
  timeout = 6.0

  def call(rt):
    if rt.index == 4:
      return 'stays away'
    return _tree_broadcast(rt, timeout=timeout)

  results = fake.run(rts, call)
  rest = [r for p, r in enumerate(results) if p != 4]
  for e in _errors_of(rest, errors.CollectiveTimeoutError):
    assert list(e.missing) == [4], e
  for _, seconds in rest:
    assert timeout <= seconds < timeout + 2.0
