"""The control plane's failure paths, on an in-memory coordination service.

Each test runs a few "processes" as threads of this one, each with its own
`multihost._runtime.Runtime` on one `fake_coordination.FakeService`, and
calls the control plane (`_control_agree`) with that runtime. The
real-process tests of the same paths (test_failures.py, test_security.py,
test_collectives.py) stay: they cover what a fake cannot (signals, gloo,
the real service's timing).
"""

from __future__ import annotations

import time

import fake_coordination as fake
import pytest

from multihost import _control_agree
from multihost import _coordination
from multihost import _errors
from multihost import _exit
from multihost import _leaves
from multihost import _runtime
from multihost import _watchdog
from multihost import _where

Header = _control_agree.Header


@pytest.fixture
def job(request):
  """(service, runtimes) of `request.param` processes (3 by default), stopped after the test."""
  count = getattr(request, 'param', 3)
  service, rts = fake.runtimes(count)
  for rt in rts:  # As multihost.initialize() does.
    _watchdog.of(rt).start(heartbeat_timeout=2)
    _where.of(rt).ensure_started()
  yield service, rts
  fake.stop(rts)


def _errors_of(results, kind):
  for i, (out, _) in enumerate(results):
    assert isinstance(out, kind), f'process {i}: {out!r}'
  return [out for out, _ in results]


def test_the_fake_and_jaxs_client_are_coordination_clients():
  assert isinstance(fake.FakeService(2).client(0), _coordination.Client)
  assert isinstance(_coordination.JaxClient(object()), _coordination.Client)


def test_the_exit_sequence_runs_in_order_once():
  """Responder first (no key-value get in flight), then the handshake, then the companion."""
  rt = _runtime.Runtime(None)
  ran = []
  for name in ('companion', 'handshake', 'where'):
    rt.exit_steps[name] = lambda name=name: ran.append(name)
  rt.shutdown()
  rt.shutdown()
  assert ran == ['where', 'handshake', 'companion']


def test_agreement_on_the_fast_path(job):
  _, rts = job
  results = fake.run(rts, lambda rt: _control_agree.agree(
      Header('sync_global_devices', name='x'), timeout=10, runtime=rt))
  assert [out for out, _ in results] == [_control_agree.Agreement(True)] * 3
  assert all(seconds < 0.9 for _, seconds in results)  # no 1 s window


def test_a_timeout_names_the_missing_process(job):
  _, rts = job

  def call(rt):
    if rt.index == 2:
      return 'stays away'
    return _control_agree.agree(Header('sync_global_devices', name='x'),
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
    assert 2.0 < seconds < 2.5 + 2.0


def test_a_late_process_is_told_it_arrived_late(job):
  _, rts = job
  results = fake.run(
      rts, lambda rt: _control_agree.agree(
          Header('sync_global_devices', name='x'), timeout=2, runtime=rt),
      delays={2: 3.0})
  early = _errors_of(results[:2], _errors.CollectiveTimeoutError)
  assert [list(e.missing) for e in early] == [[2], [2]]
  late, seconds = results[2]
  assert isinstance(late, _errors.CollectiveTimeoutError), late
  assert list(late.missing) == [2]
  assert str(late).startswith('[process=2] sync_global_devices: this process '
                              'arrived late')
  assert seconds < 0.8  # at once, not after its own timeout


def test_a_planted_message_is_refused_on_every_process(job):
  service, rts = job
  # Someone who reached the service writes a key into the first call's
  # directory that belongs to no process.
  service.client(99).kv_set('multihost/0/0/7', b'not a message')
  results = fake.run(rts, lambda rt: _control_agree.agree_and_gather(
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
  results = fake.run(rts, lambda rt: _control_agree.agree_and_gather(
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
    spec = _leaves.LeafSpec((2 + rt.index,), 'float32')
    header = Header('process_allgather', tree='PyTreeDef(*)', paths=('',),
                    specs=(spec,))
    outcome = _control_agree.agree(header, timeout=10, runtime=rt)
    assert not outcome.agreed  # not on the fast path
    headers = outcome.headers
    _control_agree.check_same_leaves(headers, me=rt.index)

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
  results = fake.run(rts, lambda rt: _control_agree.agree(
      Header(ops[rt.index]), timeout=10, runtime=rt))
  for p, e in enumerate(_errors_of(results, _errors.ConsistencyError)):
    assert str(e).startswith(f'[process={p}] processes called different '
                             'collectives at the same point: process [0]: '
                             "'sync_global_devices'; process [1]: "
                             "'process_allgather'")


def test_a_dead_peer_raises_process_failure_error(job):
  service, rts = job
  warm = fake.run(rts, lambda rt: _control_agree.agree(
      Header('sync_global_devices', name='warm'), timeout=10, runtime=rt))
  assert [out for out, _ in warm] == [_control_agree.Agreement(True)] * 3
  service.kill(2)
  survivors = rts[:2]
  results = fake.run(survivors, lambda rt: _control_agree.agree(
      Header('sync_global_devices', name='x'), timeout=20, runtime=rt))
  for p, e in enumerate(_errors_of(results, _errors.ProcessFailureError)):
    assert list(e.failed) == [2]
    assert str(e).startswith(f'[process={p}] sync_global_devices: '
                             'process(es) [2] failed')
  for _, seconds in results:
    assert seconds < 5.0  # the watchdog's bound, not the 20 s timeout
  # Every later collective raises at once.
  start = time.monotonic()
  later = fake.run(survivors, lambda rt: _control_agree.agree(
      Header('sync_global_devices', name='y'), timeout=20, runtime=rt))
  _errors_of(later, _errors.ProcessFailureError)
  assert time.monotonic() - start < 0.5


def test_a_peer_that_left_is_named_as_exited_not_failed(job):
  _, rts = job
  _exit.leave(rts[2])  # Process 2's exit handshake (not the service's host).
  results = fake.run(rts[:2], lambda rt: _control_agree.agree(
      Header('sync_global_devices', name='x'), timeout=20, runtime=rt))
  for p, e in enumerate(_errors_of(results, _errors.ProcessFailureError)):
    assert str(e).startswith(f'[process={p}] sync_global_devices: '
                             'process(es) [2] exited before this collective')
    assert 'failed' not in str(e).split('.')[0]
  for _, seconds in results:
    assert seconds < 5.0


def test_the_process_running_the_service_leaves_last(job):
  _, rts = job
  left = {}

  def leave(rt):
    _exit.leave(rt)
    left[rt.index] = time.monotonic()

  results = fake.run(rts, leave, delays={1: 0.5, 2: 1.5})
  assert [out for out, _ in results] == [None, None, None]
  assert left[0] >= max(left[1], left[2])  # process 0 waited for them
  host = rts[0].watchdog
  assert host.exited == {1, 2} and not host.failed
