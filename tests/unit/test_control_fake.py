"""The control plane's failure paths, on an in-memory coordination service.

Each test runs a few "processes" as threads of this one, each with its own
`multihost._src.runtime.runtime.Runtime` on one `fake_coordination.FakeService`, and
calls the control plane (`control.agree`) with that runtime. The
real-process tests of the same paths (test_failures.py, test_security.py,
test_collectives.py) stay: they cover what a fake cannot (signals, gloo,
the real service's timing).
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
import threading
import time

import fake_coordination as fake
import pytest

from multihost._src.auth import secret
from multihost._src.control import agree
from multihost._src.control import live_barrier
from multihost._src.diagnostics import where
from multihost._src.diagnostics import where_text
from multihost._src.liveness import blocking
from multihost._src.liveness import exit_handshake
from multihost._src.liveness import peer_loss_exit
from multihost._src.liveness import watchdog
from multihost._src.runtime import coordination
from multihost._src.runtime import errors as _errors
from multihost._src.runtime import leaves
from multihost._src.runtime import runtime
import multihost.env

Header = agree.Header


@pytest.fixture
def job(request):
  """(service, runtimes) of `request.param` processes (3 by default), stopped after the test."""
  count = getattr(request, 'param', 3)
  service, rts = fake.runtimes(count)
  for rt in rts:  # As multihost.initialize() does.
    # Threads stand for processes here: none may leave with os._exit(75)
    # (the tests of that policy give it an exit function of their own).
    rt.settings.exit_on_peer_failure = (False, None, None)
    rt.watchdog.start(heartbeat_timeout=2)
    rt.where.ensure_started()
  yield service, rts
  for rt in rts:
    rt.watchdog.cancel_peer_loss()
  fake.stop(rts)


def _errors_of(results, kind):
  for i, (out, _) in enumerate(results):
    assert isinstance(out, kind), f'process {i}: {out!r}'
  return [out for out, _ in results]


def test_the_fake_and_jaxs_client_are_coordination_clients():
  assert isinstance(fake.FakeService(2).client(0), coordination.Client)
  assert isinstance(coordination.JaxClient(object()), coordination.Client)


def test_the_exit_sequence_runs_in_order_once():
  """Responder first (no key-value get in flight), then the handshake, then the companion."""
  rt = runtime.Runtime(None)
  ran = []
  for name in ('companion', 'handshake', 'where'):
    rt.exit_steps[name] = lambda name=name: ran.append(name)
  rt.shutdown()
  rt.shutdown()
  assert ran == ['where', 'handshake', 'companion']


def test_agreement_on_the_fast_path(job):
  _, rts = job
  results = fake.run(rts, lambda rt: agree.agree(
      Header('sync_global_devices', name='x'), timeout=10, runtime=rt))
  assert [out for out, _ in results] == [agree.Agreement(True)] * 3
  assert all(seconds < 0.9 for _, seconds in results)  # no 1 s window


def test_a_timeout_names_the_missing_process(job):
  _, rts = job

  def call(rt):
    if rt.index == 2:
      return 'stays away'
    return agree.agree(Header('sync_global_devices', name='x'),
                                timeout=2.5, runtime=rt)

  results = fake.run(rts[:2] + rts[2:], call)
  errors = _errors_of(results[:2], _errors.CollectiveTimeoutError)
  for p, e in enumerate(errors):
    assert list(e.missing) == [2]
    assert str(e).startswith(f'[process={p}] sync_global_devices: timed out')
    assert 'waiting for process(es) [2] to arrive' in str(e)
    # Where the missing process is, from its responder.
    assert 'Where they are: process 2: main thread in' in str(e)
  for _, seconds in results[:2]:
    assert 2.5 <= seconds < 2.5 + 2.0


@pytest.mark.parametrize('job', [2], indirect=True)
def test_a_timeout_never_fires_before_its_bound(job):
  # 4 s: after the fast path's 1 s window, the full exchange's barrier gets
  # the 3 s left, which the service must be asked for whole (it fails a
  # barrier at its deadline or up to a second later, never before).
  _, rts = job
  results = fake.run(rts[:1], lambda rt: agree.agree(
      Header('sync_global_devices', name='x'), timeout=4, runtime=rt))
  error, seconds = results[0]
  assert isinstance(error, _errors.CollectiveTimeoutError), error
  assert 4.0 <= seconds < 4.0 + 1.5, seconds
  # The message says when it gave up: never before the bound (under load
  # the report may read 4.1 s or later, within the bound above).
  said = re.search(r'timed out after ([0-9.]+) s \(timeout=4 s\)', str(error))
  assert said and 4.0 <= float(said.group(1)) < 4.0 + 1.5, str(error)


def test_a_late_process_is_told_it_arrived_late_and_by_how_much(job):
  _, rts = job
  results = fake.run(
      rts, lambda rt: agree.agree(
          Header('sync_global_devices', name='x'), timeout=2, runtime=rt),
      delays={2: 3.0})
  early = _errors_of(results[:2], _errors.CollectiveTimeoutError)
  assert [list(e.missing) for e in early] == [[2], [2]]
  late, seconds = results[2]
  assert isinstance(late, _errors.CollectiveTimeoutError), late
  assert list(late.missing) == [2]
  assert str(late).startswith('[process=2] sync_global_devices: this process '
                              'arrived late')
  # It started the call 3 s after the others (the delay), not "0.0 s more".
  m = re.search(r'it got there ([\d.]+) s after them', str(late))
  assert m, str(late)
  assert 2.9 <= float(m.group(1)) < 3.5, str(late)
  assert seconds < 0.8  # at once, not after its own timeout


@pytest.mark.parametrize('job', [2], indirect=True)
@pytest.mark.parametrize('source', ['argument', 'setter', 'environment'])
def test_the_timeout_advice_names_what_set_the_timeout(job, source,
                                                       monkeypatch):
  _, rts = job
  rt = rts[0]
  if source == 'setter':
    rt.settings.default_timeout = 1.5
  elif source == 'environment':
    monkeypatch.setenv(multihost.env.TIMEOUT, '1.5')
  timeout = rt.resolve_timeout(1.5 if source == 'argument' else None)
  results = fake.run([rt], lambda rt: agree.agree(
      Header('sync_global_devices', name='x'), timeout=timeout, runtime=rt))
  message = str(results[0][0])
  advice = {'argument': 'or pass a larger timeout=.',
            'setter': 'pass a larger value to multihost.set_default_timeout(), '
                      'which set this timeout',
            'environment': 'set a larger $MULTIHOST_TIMEOUT, which set this '
                           'timeout'}
  assert advice[source] in message, message
  for other in set(advice) - {source}:
    assert advice[other] not in message, message


@pytest.mark.parametrize('job', [2], indirect=True)
def test_after_a_timeout_the_where_report_no_longer_says_waiting(job):
  _, rts = job
  results = fake.run(rts[:1], lambda rt: agree.agree(
      Header('sync_global_devices', name='x'), timeout=1.5, runtime=rt))
  assert isinstance(results[0][0], _errors.CollectiveTimeoutError)
  # Process 1 asks where process 0 is, as a SIGUSR1 or multihost.where() does.
  report = where.ask([0], runtime=rts[1])[0]
  text = where_text.where_text({0: report}, timeout=1.5)
  assert 'now waiting in' not in text, text
  assert 'not in a collective' in text, text
  assert ("sync_global_devices('x') (call 0) raised CollectiveTimeoutError "
          'here') in text, text


@pytest.mark.parametrize('job', [2], indirect=True)
def test_a_where_request_written_after_a_later_one_is_still_answered(job):
  # Two requesters take numbers n and n+1; n+1's request is written first,
  # and n's only after process 0's responder gave up polling for n (1 s).
  # Process 0 must answer both (CI once saw n skipped for good: its
  # requester then reported process 0 as "not answering").
  service, rts = job
  del service
  client = rts[1].client
  key = secret.job_keys('where', timeout=5, runtime=rts[1])[1]
  late = client.kv_increment('multihost_where/count', 1) - 1
  early = client.kv_increment('multihost_where/count', 1) - 1
  body = json.dumps({'from': 1, 'to': [0]}).encode()
  for n in (early, late):
    name = f'multihost_where/req/{n}'
    client.kv_set(name, where._seal(key, name, body))  # pylint: disable=protected-access
    if n == early:
      time.sleep(1.3)
  for n in (early, late):
    name = f'multihost_where/resp/{n}/0'
    try:
      answer = client.kv_get(name, 2.5)
    except Exception as e:  # noqa: BLE001
      raise AssertionError(f'request {n} was not answered: {e}') from None
    assert json.loads(answer[16:])['process'] == 0


def _policy(rt, grace):
  """Gives `rt`'s watchdog a leave-on-peer-failure policy that records the exit instead."""
  exits = []
  policy = peer_loss_exit.PeerLossExit(exit_fn=exits.append)
  policy.configure(enabled=True, grace=grace)
  rt.watchdog.use_peer_loss(policy)
  return exits


def _wait_for(predicate, timeout):
  deadline = time.monotonic() + timeout
  while not predicate() and time.monotonic() < deadline:
    time.sleep(0.05)
  return predicate()


@pytest.mark.parametrize('job', [2], indirect=True)
def test_a_peer_failure_that_reaches_no_call_makes_the_process_leave(
    job, caplog):
  # Process 0's main thread is elsewhere (a jitted step, here this test):
  # no multihost call raises, so after the grace it leaves with status 75
  # and one line naming process 1 and where its main thread is.
  service, rts = job
  fake.run(rts, lambda rt: agree.agree(
      Header('sync_global_devices', name='warm'), timeout=10, runtime=rt))
  exits = _policy(rts[0], grace=0.3)
  service.kill(1)
  assert _wait_for(lambda: exits, 5), 'process 0 did not leave'
  assert exits == [75]
  lines = [r.getMessage() for r in caplog.records
           if 'leaving with exit status 75' in r.getMessage()]
  assert len(lines) == 1, caplog.text
  line = lines[0]
  assert line.startswith('[process=0] ') and 'process(es) [1] failed' in line
  assert 'main thread in ' in line and 'test_control_fake.py' in line, line
  assert ("last completed collective: sync_global_devices('warm') (call 0)"
          in line), line


@pytest.mark.parametrize('job', [2], indirect=True)
def test_a_peer_failure_raised_by_a_collective_does_not_make_it_leave(job):
  service, rts = job
  # A grace longer than the fast path's unwatched 1 s window (7 s by
  # default), within which the collective raises.
  exits = _policy(rts[0], grace=1.5)
  service.kill(1)
  results = fake.run(rts[:1], lambda rt: agree.agree(
      Header('sync_global_devices', name='x'), timeout=20, runtime=rt))
  assert isinstance(results[0][0], _errors.ProcessFailureError)
  time.sleep(2.0)  # Past the grace.
  assert exits == []


@pytest.mark.parametrize('job', [2], indirect=True)
def test_the_exit_handshake_cancels_leaving_on_a_peer_failure(job):
  service, rts = job
  exits = _policy(rts[0], grace=0.5)
  rts[0].watchdog.set_shutdown_timeout(1.0)
  service.kill(1)
  assert _wait_for(lambda: rts[0].watchdog.snapshot().failed, 5)
  exit_handshake.leave(rts[0])  # The normal exit sequence, inside the grace.
  time.sleep(1.0)
  assert exits == []


@pytest.mark.parametrize('why', ['timeout', 'uncaught', 'none'])
def test_the_service_host_does_not_wait_for_peers_after_an_error(
    job, why, monkeypatch):
  # Processes 1 and 2 never leave. Process 0, which runs the service, waits
  # for them at exit up to shutdown_timeout when it leaves normally; after
  # its last collective timed out waiting for them (known stuck) it does
  # not wait at all; when the program ends with an uncaught exception, it
  # waits only _EXIT_GRACE_S for them (5 s; 1.5 s here, a third of the
  # shutdown timeout, which keeps the cases apart).
  _, rts = job
  host = rts[0]
  host.watchdog.set_shutdown_timeout(4.5)
  monkeypatch.setattr(exit_handshake, '_EXIT_GRACE_S', 1.5)
  if why == 'timeout':
    fake.run([host], lambda rt: agree.agree(
        Header('sync_global_devices', name='x'), timeout=1.5, runtime=rt))
  elif why == 'uncaught':
    host.uncaught = 'ValueError'
  start = time.monotonic()
  exit_handshake.leave(host)
  took = time.monotonic() - start
  if why == 'none':
    assert took >= 4.5, took  # It waited for them.
  elif why == 'uncaught':
    assert 1.5 <= took < 3.5, took
  else:
    assert took < 1.4, took


def test_a_planted_message_is_refused_on_every_process(job):
  service, rts = job
  # Someone who reached the service writes a key into the first call's
  # directory that belongs to no process.
  service.client(99).kv_set('multihost/0/0/7', b'not a message')
  results = fake.run(rts, lambda rt: agree.agree_and_gather(
      Header('process_allgather', payload=b'row %d' % rt.index),
      timeout=10, runtime=rt))
  for p, e in enumerate(_errors_of(results, _errors.MultihostError)):
    assert str(e).startswith(f'[process={p}] process_allgather: the control '
                             "message under key 'multihost/0/0/7'")
    assert 'is not the key of any process of this call' in str(e)


def test_an_altered_message_fails_authentication_on_every_process(job):
  service, rts = job

  def flip(key, value, process):
    if key == 'multihost/0/0/1':
      return value[:-1] + bytes([value[-1] ^ 1])
    return value

  service.tamper = flip
  results = fake.run(rts, lambda rt: agree.agree_and_gather(
      Header('process_allgather', payload=b'row %d' % rt.index),
      timeout=10, runtime=rt))
  for p, e in enumerate(_errors_of(results, _errors.MultihostError)):
    assert str(e).startswith(f'[process={p}] process_allgather: the control '
                             "message under key 'multihost/0/0/1'")
    assert 'failed authentication with the job secret' in str(e)


@pytest.mark.parametrize('job', [2], indirect=True)
def test_a_disagreement_raises_consistency_error_on_every_process(job):
  _, rts = job

  def call(rt):
    spec = leaves.LeafSpec((2 + rt.index,), 'float32')
    header = Header('process_allgather', tree='PyTreeDef(*)', paths=('',),
                    specs=(spec,))
    outcome = agree.agree(header, timeout=10, runtime=rt)
    assert not outcome.agreed  # not on the fast path
    headers = outcome.headers
    agree.check_same_leaves(headers, me=rt.index)

  results = fake.run(rts, call)
  for p, e in enumerate(_errors_of(results, _errors.ConsistencyError)):
    message = str(e)
    assert message.startswith(f'[process={p}] process_allgather: the inputs '
                              'differ across processes (processes [1] differ '
                              'from the rest)')
    assert 'float32[2] but process 1 has float32[3]' in message


@pytest.mark.parametrize('job', [2], indirect=True)
def test_different_collectives_raise_consistency_error_everywhere(job):
  _, rts = job
  ops = ['sync_global_devices', 'process_allgather']
  results = fake.run(rts, lambda rt: agree.agree(
      Header(ops[rt.index]), timeout=10, runtime=rt))
  for p, e in enumerate(_errors_of(results, _errors.ConsistencyError)):
    assert str(e).startswith(f'[process={p}] processes called different '
                             'collectives at the same point: process [0]: '
                             "'sync_global_devices'; process [1]: "
                             "'process_allgather'")


def test_a_dead_peer_raises_process_failure_error(job):
  service, rts = job
  warm = fake.run(rts, lambda rt: agree.agree(
      Header('sync_global_devices', name='warm'), timeout=10, runtime=rt))
  assert [out for out, _ in warm] == [agree.Agreement(True)] * 3
  service.kill(2)
  survivors = rts[:2]
  results = fake.run(survivors, lambda rt: agree.agree(
      Header('sync_global_devices', name='x'), timeout=20, runtime=rt))
  for p, e in enumerate(_errors_of(results, _errors.ProcessFailureError)):
    assert list(e.failed) == [2]
    assert str(e).startswith(f'[process={p}] sync_global_devices: '
                             'process(es) [2] failed')
  for _, seconds in results:
    assert seconds < 5.0  # the watchdog's bound, not the 20 s timeout
  # Every later collective raises at once.
  start = time.monotonic()
  later = fake.run(survivors, lambda rt: agree.agree(
      Header('sync_global_devices', name='y'), timeout=20, runtime=rt))
  _errors_of(later, _errors.ProcessFailureError)
  assert time.monotonic() - start < 0.5


def test_a_peer_that_left_is_named_as_exited_not_failed(job):
  _, rts = job
  exit_handshake.leave(rts[2])  # Process 2's exit handshake (not the service's host).
  results = fake.run(rts[:2], lambda rt: agree.agree(
      Header('sync_global_devices', name='x'), timeout=20, runtime=rt))
  for p, e in enumerate(_errors_of(results, _errors.ProcessFailureError)):
    assert str(e).startswith(f'[process={p}] sync_global_devices: '
                             'process(es) [2] exited before this collective')
    assert 'failed' not in str(e).split('.')[0]
  for _, seconds in results:
    assert seconds < 5.0


def _call_while_2_leaves(rts, rest, *, after_error=False, timeout=None):
  """Process 0's watched call, whose step ends `rest` s after its watchdog saw process 2 leave; (result or error, seconds)."""
  never = threading.Event()
  if after_error:
    rts[2].uncaught = 'RuntimeError'  # Process 2 leaves after an error.

  def step():
    # Process 2 left (say right after passing this step's barrier); what is
    # left of the step here takes `rest` s (None: never ends).
    deadline = time.monotonic() + 10
    while 2 not in rts[0].watchdog.snapshot().exited and time.monotonic() < deadline:
      time.sleep(0.01)
    if rest is None:
      never.wait(30)
    time.sleep(rest or 0)
    return 'done'

  threading.Timer(0.2, exit_handshake.leave, (rts[2],)).start()
  try:
    start = time.monotonic()
    try:
      return blocking.call('commit checkpoint', step, runtime=rts[0],
                           timeout=timeout), time.monotonic() - start
    except _errors.ProcessFailureError as e:
      return e, time.monotonic() - start
  finally:
    never.set()


def test_a_call_a_peer_left_right_after_still_completes(job):
  _, rts = job
  out, _ = _call_while_2_leaves(rts, rest=1.0)
  assert out == 'done', out
  assert rts[0].watchdog.snapshot().exited_normally == {2}


def test_a_call_a_peer_left_without_raises_after_the_grace(job):
  _, rts = job
  out, seconds = _call_while_2_leaves(rts, rest=None)
  assert isinstance(out, _errors.ProcessFailureError), out
  assert str(out).startswith('[process=0] commit checkpoint: process(es) '
                             '[2] exited before this collective'), out
  assert blocking.EXITED_GRACE_S <= seconds < blocking.EXITED_GRACE_S + 3


def test_with_a_timeout_the_grace_after_a_normal_exit_stays_its_own(job):
  """A call with a finite timeout (20 s) that a peer left normally gets the grace (5 s), not the rest of its timeout."""
  _, rts = job
  out, seconds = _call_while_2_leaves(rts, rest=None, timeout=20.0)
  assert isinstance(out, _errors.ProcessFailureError), out
  assert 'exited before this collective' in str(out), out
  assert blocking.EXITED_GRACE_S <= seconds < blocking.EXITED_GRACE_S + 3, (
      seconds)


def test_a_peer_that_left_after_an_error_gets_no_grace(job):
  _, rts = job
  out, seconds = _call_while_2_leaves(rts, rest=1.0, after_error=True)
  assert isinstance(out, _errors.ProcessFailureError), out
  assert seconds < 3, seconds  # The watchdog's poll, not the grace.
  peers = rts[0].watchdog.snapshot()
  assert peers.exited == {2}
  assert not peers.exited_normally


def test_the_process_running_the_service_leaves_last(job):
  _, rts = job
  left = {}

  def leave(rt):
    exit_handshake.leave(rt)
    left[rt.index] = time.monotonic()

  results = fake.run(rts, leave, delays={1: 0.5, 2: 1.5})
  assert [out for out, _ in results] == [None, None, None]
  assert left[0] >= max(left[1], left[2])  # process 0 waited for them
  host = rts[0].watchdog.snapshot()
  assert host.exited == {1, 2} and not host.failed


def test_the_docs_and_the_watchdog_give_the_same_detection_bound(caplog):
  caplog.set_level(logging.INFO)
  text = (pathlib.Path(__file__).resolve().parents[2] / 'docs' /
          'failures.md').read_text()
  m = re.search(
      r'within the heartbeat timeout \+ (\d+) s: (\d+) s by\s+default', text)
  assert m, 'docs/failures.md no longer states the detection bound'
  slack, bound = float(m.group(1)), float(m.group(2))
  service, rts = fake.runtimes(2)
  rt = rts[0]
  rt.settings.exit_on_peer_failure = (False, None, None)
  wd = rt.watchdog
  try:
    assert wd.start(heartbeat_timeout=multihost.env.DEFAULT_HEARTBEAT_S)
    assert wd.detection_bound() == bound
    assert slack == watchdog.DETECTION_SLACK_S
    assert (f'reported within {bound:.1f} s (heartbeat timeout '
            f'{multihost.env.DEFAULT_HEARTBEAT_S:g} s + {slack:g} s)'
            ) in caplog.text
  finally:
    fake.stop(rts)


def test_the_live_barrier_of_block_32_deletes_group_0s_keys(job):
  service, rts = job
  service.client(0).kv_set('multihost_live/w/0/0/enter.here/0', b'old')
  results = fake.run(rts, lambda rt: live_barrier.meet(
      'w', 32, 'enter', frozenset({0, 1, 2}), timeout=10, runtime=rt))
  for p, (out, _) in enumerate(results):
    assert out == (frozenset({0, 1, 2}), {}), (p, out)
  assert not [k for k in service.store if k.startswith('multihost_live/w/0/')]


def test_a_shared_setting_that_differs_is_named_on_every_process(job):
  """$MULTIHOST_TCP_LANES differing across processes is a ConsistencyError everywhere, naming the variable and each process's value."""
  _, rts = job

  def call(rt):
    lanes = '3' if rt.index == 1 else '2'
    header = Header('broadcast_one_to_all', size=8, settings=(
        (multihost.env.TCP_LANES, lanes), (multihost.env.TRANSPORT, 'unset')))
    return agree.agree(header, timeout=10, runtime=rt)

  results = fake.run(rts, call)
  for e in _errors_of(results, _errors.ConsistencyError):
    assert 'MULTIHOST_TCP_LANES differs across processes' in str(e), e
    assert "processes [1] differ" in str(e) and "1: '3'" in str(e), e
  assert all(t < 5 for _, t in results), results  # At once, not a timeout.


def test_every_header_carries_the_shared_settings(monkeypatch):
  monkeypatch.setenv(multihost.env.TCP_LANES, '3')
  monkeypatch.delenv(multihost.env.TRANSPORT, raising=False)
  header = Header('sync_global_devices')
  assert dict(header.settings) == {'MULTIHOST_TCP_LANES': '3',
                                   'MULTIHOST_TRANSPORT': 'unset'}
  monkeypatch.setenv(multihost.env.TCP_LANES, '2')
  assert Header('sync_global_devices').agreement() != header.agreement()


def test_agreement_digests_are_remembered_within_a_bound():
  """A header's digest is looked up once made (the same bytes as made anew), headers with a list inside (global layouts) still get theirs, and the remembered digests never pass their bound."""
  agree._DIGESTS.clear()
  header = Header('broadcast_one_to_all', tree='PyTreeDef(*)', paths=('a',),
                  default_source=True)
  first = header.agreement()
  assert header.agreement() == first == agree._digest(next(iter(
      agree._DIGESTS)))
  assert len(agree._DIGESTS) == 1
  layouts = Header('process_allgather', layouts=([((0, 4),)],), tiled=True)
  assert layouts.agreement() == layouts.agreement() != first
  assert len(agree._DIGESTS) == 1  # (not hashable: made each time)
  names = set()
  for i in range(3 * agree._DIGESTS_MAX):
    names.add(Header('sync_global_devices', name=str(i)).agreement())
    assert len(agree._DIGESTS) <= agree._DIGESTS_MAX
  assert len(names) == 3 * agree._DIGESTS_MAX  # every name its own digest
  assert Header('broadcast_one_to_all', tree='PyTreeDef(*)', paths=('a',),
                default_source=True).agreement() == first
