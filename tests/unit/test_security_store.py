"""Attacks through the key-value store and on the job secret, on an in-memory coordination service (threads stand for processes).

Whoever reaches the coordination service can write any key. These tests
play that writer: a planted gave-up mark, a control message recorded in
another run with the same secret, a forged data-plane address, where-
requests from a process without the secret, a bumped request counter; and
the secret's own checks (its file, its length, what the store shows of it).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
import time

import fake_coordination as fake
import pytest

from multihost import env as env_lib
from multihost._src.auth import marks
from multihost._src.auth import secret as _secret
from multihost._src.control import agree
from multihost._src.control import live_barrier
from multihost._src.control import rendezvous
from multihost._src.diagnostics import where
from multihost._src.runtime import errors
from multihost._src.transport.tcp import auth
from multihost._src.transport.tcp import handshake
from multihost._src.transport.tcp import link as _tcp_link

Header = agree.Header
SECRET = 'ab' * 32


@pytest.fixture
def secret(monkeypatch):
  """A configured job secret (as the launcher gives one), for this test only."""
  monkeypatch.setattr(_secret, '_TAKEN', {})
  monkeypatch.setenv(env_lib.JOB_SECRET, SECRET)
  yield SECRET
  monkeypatch.setattr(_secret, '_TAKEN', {})


def _job(count=3):
  service, rts = fake.runtimes(count)
  for rt in rts:
    rt.watchdog.start(heartbeat_timeout=2)
    rt.where.ensure_started()
  return service, rts


def _gather(rts, timeout=10):
  return fake.run(rts, lambda rt: agree.agree_and_gather(
      Header('process_allgather', payload=b'row %d' % rt.index),
      timeout=timeout, runtime=rt))


# --- Control messages are bound to the job ---------------------------------


def test_a_message_recorded_in_another_run_with_the_same_secret_is_refused(
    secret):
  del secret
  _, run_a = _job()
  try:
    assert not any(isinstance(o, Exception) for o, _ in _gather(run_a))
    recorded = run_a[0].client.kv_try_get('multihost/0/0/0')
    assert recorded is not None
  finally:
    fake.stop(run_a)
  service, run_b = _job()
  try:
    # Run B's process 0's message of the same call replaced by run A's.
    service.tamper = lambda key, value, p: (
        recorded if key == 'multihost/0/0/0' else value)
    results = _gather(run_b)
    for p, (e, _) in enumerate(results):
      assert isinstance(e, errors.MultihostError), (p, e)
      assert 'failed authentication with the job secret' in str(e), e
  finally:
    fake.stop(run_b)


def test_a_planted_gave_up_mark_does_not_make_anyone_arrive_late(secret):
  del secret
  service, rts = _job()
  try:
    writer = service.client(99)
    # Beside the first call's messages: one for a process that does not
    # exist, one for process 1 without its MAC.
    for key in ('multihost/0/0.gave-up/7', 'multihost/0/0.gave-up/1'):
      writer.kv_set(key, b'')

    def exchange(rt):
      return rendezvous.Rendezvous(rt, 'process_allgather').exchange(
          b'row %d' % rt.index, timeout=10)

    results = fake.run(rts, exchange)
    for p, (out, _) in enumerate(results):
      assert out == [b'row 0', b'row 1', b'row 2'], (p, out)
  finally:
    fake.stop(rts)


# The keys of the live barrier of block 0's entry, of the processes 'w'.
_LIVE = 'multihost_live/w/0/0/enter'


def _live_meet(timeout):
  return lambda rt: live_barrier.meet('w', 0, 'enter', frozenset({0, 1, 2}),
                                      timeout=timeout, runtime=rt)


def test_a_planted_gave_up_mark_does_not_end_a_live_barrier(secret):
  del secret
  service, rts = _job()
  try:
    writer = service.client(99)
    # As a process that gave up would leave them, without their MAC: one of
    # process 1 giving up on process 0, one of a process that does not exist.
    writer.kv_set(f'{_LIVE}.gave-up/1', b'0')
    writer.kv_set(f'{_LIVE}.gave-up/7', b'0,1')
    # Process 2 comes after a barrier window: 0 and 1 look for marks.
    results = fake.run(rts, _live_meet(timeout=20), delays={2: 2.5})
    for p, (out, _) in enumerate(results):
      assert out == (frozenset({0, 1, 2}), {}), (p, out)
  finally:
    fake.stop(rts)


def test_a_forged_presence_mark_does_not_hide_the_missing_process(secret):
  del secret
  service, rts = _job()
  try:
    # Process 2 never comes; a store writer says it is there.
    service.client(99).kv_set(f'{_LIVE}.here/2', b'')
    results = fake.run(rts, lambda rt: (
        None if rt.index == 2 else _live_meet(timeout=2.5)(rt)))
    for p, (out, _) in enumerate(results[:2]):
      assert isinstance(out, errors.CollectiveTimeoutError), (p, out)
      assert out.missing == (2,), (p, out)
  finally:
    fake.stop(rts)


def test_a_mark_moved_to_another_key_or_badly_maced_is_ignored(secret):
  del secret
  _, rts = _job()
  try:
    for rt in rts:  # The job key (process 0 first: it publishes the job id).
      _secret.job_secret('test', timeout=5, runtime=rt)
    op, call = 'live_devices', 'multihost/0/0/'
    marks.leave_mark(rts[1], op, call, time.monotonic(), given_up_on=[0])
    [mark] = marks.gave_up(rts[0], op, call)
    assert (mark.process, mark.given_up_on) == (1, frozenset({0}))
    assert marks.gave_up(rts[0], op, call, processes={0, 2}) == []
    # Process 1's authentic mark of a call, moved to a live barrier's.
    moved = rts[0].client.kv_try_get('multihost/0/0.gave-up/1')
    rts[0].client.kv_set(f'{_LIVE}.gave-up/1', moved)
    assert marks.gave_up(rts[0], op, _LIVE + '/') == []
    here = f'{_LIVE}.here/'
    marks.leave_presence(rts[2], op, here)
    assert marks.published(rts[0], op, here) == [2]
    rts[0].client.kv_set(here + '1', rts[0].client.kv_try_get(here + '2'))
    rts[0].client.kv_set(here + '0', b'\0' * marks.MAC + b'here')
    assert marks.published(rts[0], op, here) == [2]
    assert marks.absent(rts[0], op, here) == [0, 1]
  finally:
    fake.stop(rts)


# --- Data-plane addresses --------------------------------------------------


def test_a_data_plane_address_written_by_a_store_writer_is_refused():
  key = os.urandom(32)
  real = auth.address_record(key, 2, '10.0.0.3', 4242, 'multihost-ab12')
  assert auth.read_address(key, 2, real, 'op') == ('10.0.0.3', 4242,
                                                    'multihost-ab12')
  relay = b'127.0.0.1|5555'  # as the store held before: no MAC
  moved = real.replace(b'10.0.0.3|4242', b'127.0.0.1|5555')  # MAC kept
  # Another local socket name (a stranger's on the same host), MAC kept:
  renamed = real.replace(b'multihost-ab12', b'multihost-cd34')
  other = auth.address_record(key, 1, '127.0.0.1', 5555)  # another's
  for forged in (relay, moved, renamed, other, b'', b'|||'):
    with pytest.raises(errors.MultihostError,
                       match="'multihost_transport/2' failed authentication"):
      auth.read_address(key, 2, forged, 'process_allgather')


# --- Where-requests ----------------------------------------------------------


def test_a_process_without_the_secret_gets_no_stacks_and_silences_no_one(
    secret):
  del secret
  service, rts = _job(2)
  try:
    for rt in rts:
      _secret.job_keys(timeout=5, runtime=rt)
    outsider = fake.runtimes(2)[1][1]
    outsider.client = service.client(1)
    outsider.job_keys = (rts[1].job_keys[0], b'w' * 32)  # a wrong secret
    assert where.ask([0], timeout=2.5, runtime=outsider) == {0: None}
    # An 8 MiB request, correctly numbered, without a MAC: not answered.
    writer = service.client(1)
    n = writer.kv_increment('multihost_where/count', 1) - 1
    writer.kv_set(f'multihost_where/req/{n}', json.dumps(
        {'to': [0], 'pad': 'x' * (8 << 20)}).encode())
    time.sleep(1.5)
    assert writer.kv_try_get(f'multihost_where/resp/{n}/0') is None
    # One counter increment far ahead: a later real request is answered.
    writer.kv_increment('multihost_where/count', 1_000_000)
    report = where.ask([0], timeout=4, runtime=rts[1])[0]
    assert report is not None and report['process'] == 0
    # The requester deleted its request and the answers.
    left = [k for k, _ in writer.kv_dir('multihost_where/')
            if k.startswith(('multihost_where/resp/',
                             f'multihost_where/req/{n + 1}'))]
    assert left == [], left
  finally:
    fake.stop(rts)


# --- The secret ----------------------------------------------------------------


def test_a_short_secret_is_refused_with_how_to_make_one(monkeypatch):
  monkeypatch.setattr(_secret, '_TAKEN', {})
  monkeypatch.setenv(env_lib.JOB_SECRET, 'hunter2')
  with pytest.raises(errors.MultihostError) as e:
    _secret.configured()
  assert 'of 7 bytes; at least 32' in str(e.value), e.value
  assert 'openssl rand -hex 32' in str(e.value), e.value
  # What the launcher makes for its controllers is long enough.
  made = env_lib.job_secret_env({})[env_lib.JOB_SECRET]
  assert len(made.encode()) >= _secret.MIN_SECRET_BYTES


def test_a_secret_file_link_flipped_between_600_and_644_is_never_used(
    tmp_path, monkeypatch):
  private, public = tmp_path / 'private', tmp_path / 'public'
  private.write_text('p' * 64)
  private.chmod(0o600)
  public.write_text('o' * 64)
  public.chmod(0o644)
  link = tmp_path / 'secret'
  link.symlink_to(private)
  monkeypatch.setattr(_secret, '_TAKEN', {})
  monkeypatch.delenv(env_lib.JOB_SECRET, raising=False)
  monkeypatch.setenv(env_lib.JOB_SECRET_FILE, str(link))
  stop = threading.Event()

  def flip():
    spare = tmp_path / 'spare'
    while not stop.is_set():
      for target in (public, private):
        spare.unlink(missing_ok=True)
        spare.symlink_to(target)
        os.replace(spare, link)

  flipper = threading.Thread(target=flip, daemon=True)
  flipper.start()
  used, refused = [], 0
  try:
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
      try:
        used.append(_secret.configured())
      except errors.MultihostError as e:
        assert 'a symbolic link is refused' in str(e), e
        refused += 1
  finally:
    stop.set()
    flipper.join(5)
  assert used == [] and refused > 0, (len(used), refused)
  # A regular file of mode 600 is used.
  monkeypatch.setenv(env_lib.JOB_SECRET_FILE, str(private))
  assert _secret.configured() == b'p' * 64
  private.chmod(0o640)
  with pytest.raises(errors.MultihostError, match='chmod 600'):
    _secret.configured()


def test_what_the_store_shows_does_not_give_the_secret_to_a_word_list(secret):
  words = [w * 8 for w in ('hunter2', 'password', 'letmein')] + [secret]
  published = []
  for _ in range(2):  # two runs with the same secret
    service, rts = fake.runtimes(2)
    fake.run(rts, lambda rt: _secret.job_keys(timeout=5, runtime=rt))
    published.append(service.store['multihost_secret/job'])
  assert published[0] != published[1]  # a fresh job id and check per job
  value = published[0]
  job, check = value[:16], value[17:]
  for word in words:  # the fast guesses: no scrypt
    w = word.encode()
    for guess in (hmac.digest(w, b'multihost fingerprint', hashlib.sha256),
                  hmac.digest(w, b'multihost secret check', hashlib.sha256),
                  hmac.digest(w, job, hashlib.sha256)):
      assert guess[:len(check)] != check and guess[:8] not in value
  # Each guess that could match costs one scrypt of the job id.
  start = time.monotonic()
  for word in words[:3]:
    _secret.derive(word.encode(), job)
  assert (time.monotonic() - start) / 3 > 0.005


# --- Strangers at a data-plane port ------------------------------------------


@pytest.fixture(params=['tcp', 'local'])
def plane(secret, monkeypatch, request):
  """Process 1's data-plane listener (of 2), with a 1 s handshake deadline, and a function that connects a stranger to it: its TCP port, or its local socket."""
  import socket  # noqa: PLC0415
  del secret
  monkeypatch.setattr(handshake, 'HANDSHAKE_S', 1.0)
  _, rts = fake.runtimes(2)
  fake.run(rts, lambda rt: _secret.job_keys(timeout=5, runtime=rt))
  p = _tcp_link.Plane(rts[1], 5.0, 'test')
  host, port, local = auth.read_address(
      rts[1].job_keys[1], 1,
      rts[1].client.kv_try_get(auth.ADDRESS_KEY.format(1)), 'test')
  assert local, 'the plane publishes no local socket'

  def connect():
    if request.param == 'tcp':
      return socket.create_connection((host, port), timeout=5)
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(b'\0' + local.encode())
    return s

  yield p, connect
  _tcp_link.close_plane(p)
  fake.stop(rts)


def _closed_within(s, seconds: float) -> bool:
  """Whether the listener closes `s` within `seconds` (we send nothing)."""
  s.settimeout(seconds)
  try:
    return s.recv(64) == b''
  except TimeoutError:
    return False
  except OSError:
    return True


def test_a_handshake_trickling_a_byte_at_a_time_is_cut_at_its_deadline(plane):
  _, connect = plane
  s = connect()
  start = time.monotonic()
  try:
    cut = False
    while time.monotonic() - start < 4.0 and not cut:
      try:
        s.sendall(b'M')  # less than a hello, one byte every 0.3 s
      except OSError:
        cut = True
        break
      cut = _closed_within(s, 0.3)
    took = time.monotonic() - start
  finally:
    s.close()
  assert cut and took < 1.9, (cut, took)  # the 1 s deadline, not per recv


def test_strangers_past_the_cap_cut_the_oldest_not_the_newcomer(plane):
  p, connect = plane
  held = [connect() for _ in range(handshake.PER_SOURCE)]
  try:
    deadline = time.monotonic() + 2
    while len(p.acceptor.pending) < handshake.PER_SOURCE:
      assert time.monotonic() < deadline, len(p.acceptor.pending)
      time.sleep(0.01)
    newcomer = connect()
    held.append(newcomer)
    assert _closed_within(held[0], 0.5)  # the oldest stranger
    assert not _closed_within(newcomer, 0.2)  # a peer would go on from here
    assert not any(_closed_within(s, 0.01) for s in held[1:-1])
  finally:
    for s in held:
      s.close()


def test_after_a_failed_transfer_the_next_one_opens_new_links(secret):
  del secret
  _, rts = fake.runtimes(2)
  planes = []
  try:
    fake.run(rts, lambda rt: _secret.job_keys(timeout=5, runtime=rt))
    planes = [_tcp_link.Plane(rt, 5.0, 'test') for rt in rts]

    def transfer(rt):
      plane = planes[rt.index]
      link = plane.conn(1 - rt.index, time.monotonic() + 10, 'test')
      link.sock.settimeout(5)
      if rt.index == 0:
        link.sock.sendall(link.frame(7, 0))
      else:
        link.read_frame(7, 0, 'test', 0)
      return link

    first = [out for out, _ in fake.run(rts, transfer)]
    assert all(isinstance(l, _tcp_link.Link) for l in first), first
    # Process 0's transfer failed: it closes its links (bytes may be in
    # flight). Process 1 did not notice and keeps its end.
    _tcp_link.break_plane(planes[0], RuntimeError('cut'))
    time.sleep(0.1)
    second = [out for out, _ in fake.run(rts, transfer)]
    assert all(isinstance(l, _tcp_link.Link) for l in second), second
    assert second[0] is not first[0] and second[1] is not first[1]
  finally:
    for p in planes:
      p.listener.close()
    fake.stop(rts)
