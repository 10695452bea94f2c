"""Process-failure drills: real controllers, a real SIGKILL (or SIGSTOP); survivors raise.

Each test starts N controllers with `multihost.launch.Controllers`, lets them
loop one collective, kills one with SIGKILL (or freezes it), and checks every other
process's output: it raised `ProcessFailureError` naming the dead process,
within the watchdog's bound (heartbeat timeout + ~1 s; 3 s here), and exited
non-zero; the run's status is non-zero and nothing is left running.

Process 0 is different where it hosts JAX's coordination service itself
($MULTIHOST_COMPANION_SERVICE=0): when it dies JAX's C++ client aborts every
other process (SIGABRT) about a millisecond later, before Python can run.
That test checks that this is what happens and that the launcher's summary
says so.
"""

from __future__ import annotations

import os
import re
import signal
import time

from _helpers import held_port
from _helpers import program
import pytest

from multihost import launch
from multihost import lowlevel
import multihost.env

HEARTBEAT_S = 3
# Detection is bounded by the heartbeat timeout plus the watchdog's poll
# (0.5 s) and a rendezvous; allow for a loaded 2-core machine.
DETECTION_BOUND_S = HEARTBEAT_S + 4.0

def _start(num_processes, mode, size='small', sleeper=-1, *, port=None,
           extra_env=None):
  """tests/programs/drill.py under `launch.Controllers` (see its docstring)."""
  env = {**os.environ, 'DRILL_HB': str(HEARTBEAT_S), **(extra_env or {})}
  # The grace period must outlast the detection time, or the launcher would
  # stop the survivors before they raise.
  return launch.Controllers(
      program('drill', mode, size, sleeper),
      num_processes=num_processes, env=env, grace_period=30, port=port)


def _wait_all(cluster, text, indices, timeout=60):
  for i in indices:
    cluster.wait_for_output(i, text, timeout=timeout)


def _assert_nothing_running(cluster):
  for pid in cluster.pids:
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)


def _check_survivors(result, victim, killed_at, bound=DETECTION_BOUND_S):
  """Every other process raised ProcessFailureError naming `victim`, in time."""
  assert not result.ok, result.summary
  assert result.exit_code != 0, result.summary
  assert result.returncodes[victim] == -signal.SIGKILL, result.summary
  for i, out in enumerate(result.outputs):
    if i == victim:
      continue
    m = re.search(r'RAISED ProcessFailureError failed=\[(.*?)\] at=([\d.]+) '
                  r'message=(.*)', out)
    assert m, f'process {i} did not raise ProcessFailureError:\n{out[-3000:]}'
    assert m.group(1) == str(victim), m.group(0)
    assert f'process(es) [{victim}]' in m.group(3), m.group(0)
    latency = float(m.group(2)) - killed_at
    assert 0 < latency < bound, (i, latency, m.group(0))
    # Raised and exited with its own status (not aborted); or, if a
    # collective it abandoned was still stuck at exit, with os._exit(1).
    assert (result.returncodes[i] == 3 or result.returncodes[i] == 1 and
            'leaving with os._exit(1)' in out), (i, result.summary,
                                                 out[-3000:])


@pytest.mark.parametrize('num_processes,mode,size,victim,transport', [
    # A barrier (sync_global_devices) while the victim is not there yet
    # (at P=3 only: P=2 runs the same path, with one survivor).
    (3, 'barrier', 'small', 2, 'tcp'),
    # Collectives in a tight loop: the kill lands in (or between) them; the
    # small ones go through the service, where more than two survivors add
    # nothing over two.
    (2, 'allgather', 'small', 1, 'tcp'),
    (3, 'broadcast', 'small', 2, 'tcp'),
    # A 16 MiB broadcast on one host, through the source's stage: the kill
    # lands in the victim's copies and releases, and in the source's wait
    # for them.
    (3, 'broadcast', 'big', 1, 'tcp'),
    # The same over TCP links (no stage), in stripes over two lanes: the
    # victim is the middle of the chain, so the kill lands in a lane
    # thread's reads and forwards on both sides of it.
    (3, 'broadcast', 'big', 1, 'tcp-links'),
    # 1 MiB over TCP links at P=5, down the tree, where the answers travel
    # with the payload (in a star, as on these cores): the victim, 2, is
    # the parent of 3, so the kill lands in what 3 waits for.
    (5, 'broadcast', 'tree', 2, 'tcp-links'),
    # Device collectives over gloo. At P=4, killing 2 leaves process 0, which
    # is not its ring neighbour, blocked in gloo with no error of its own.
    (2, 'broadcast', 'big', 1, 'device'),
    (4, 'allgather', 'big', 2, 'device'),
])
def test_sigkill_of_a_peer_raises_on_every_survivor(num_processes, mode, size,
                                                    victim, transport):
  env = {multihost.env.TRANSPORT: transport.removesuffix('-links')}
  if transport == 'tcp-links':
    env[multihost.env.LOCAL_LINKS] = '0'
  transport = env[multihost.env.TRANSPORT]
  with _start(num_processes, mode, size, sleeper=victim,
              extra_env=env) as cluster:
    _wait_all(cluster, 'READY', range(num_processes))
    for i in range(num_processes):
      assert f'TRANSPORT {transport}' in cluster.outputs[i], i
    if mode == 'barrier':
      cluster.wait_for_output(victim, 'SLEEPING', timeout=60)
      time.sleep(0.3)  # The others are now waiting at the barrier.
    else:
      _wait_all(cluster, 'LOOPING', range(num_processes))
    killed_at = time.time()
    cluster.kill(victim, signal.SIGKILL)
    result = cluster.wait(timeout=60)
  assert not result.timed_out, result.summary
  _check_survivors(result, victim, killed_at)
  _assert_nothing_running(cluster)


def test_a_frozen_process_in_the_middle_of_a_relayed_broadcast_is_named():
  """SIGSTOP, not SIGKILL: process 2, the parent of process 3 in 1 MiB broadcasts down the tree over TCP links (whose answers travel with the payload where the processes agree in a star), freezes with its sockets open. Every other process raises ProcessFailureError naming it once its heartbeats stop: the processes below it, waiting for what it would pass on, and the others, waiting for it in the next call."""
  env = {multihost.env.TRANSPORT: 'tcp', multihost.env.LOCAL_LINKS: '0'}
  with _start(5, 'broadcast', 'tree', extra_env=env) as cluster:
    _wait_all(cluster, 'LOOPING', range(5))
    frozen_at = time.time()
    cluster.kill(2, signal.SIGSTOP)
    try:
      for i in (0, 1, 3, 4):
        cluster.wait_for_output(i, 'RAISED', timeout=30)
    finally:
      cluster.kill(2, signal.SIGKILL)
    result = cluster.wait(timeout=60)
  assert not result.timed_out, result.summary
  for i in (0, 1, 3, 4):
    out = result.outputs[i]
    m = re.search(r'RAISED ProcessFailureError failed=\[2\] at=([\d.]+)', out)
    assert m, f'process {i}:\n{out[-3000:]}'
    assert 0 < float(m.group(1)) - frozen_at < DETECTION_BOUND_S, (i, m.group(0))
  _assert_nothing_running(cluster)


def test_a_peer_killed_between_collectives_fails_the_next_one_at_once():
  with _start(3, 'idle') as cluster:
    _wait_all(cluster, 'READY', range(3))
    cluster.kill(1, signal.SIGKILL)
    result = cluster.wait(timeout=60)
  assert not result.timed_out, result.summary
  for i in (0, 2):
    out = result.outputs[i]
    woke = float(re.search(r'WOKE at=([\d.]+)', out).group(1))
    # Process 2 may have woken, raised and left before process 0 built its
    # error; then it is named too, as exited (process 0, which runs the
    # service, leaves last).
    gone = r'\[1\]' if i == 2 else r'\[1(?:, 2)?\]'
    raised = re.search(
        rf'RAISED ProcessFailureError failed={gone} at=([\d.]+)', out)
    assert raised, out[-3000:]
    # At once, or after the exchange's fast-path window (1 s, which the
    # service enforces with ~1 s granularity) if it does not check first.
    assert float(raised.group(1)) - woke < 3.0, out[-3000:]
    assert result.returncodes[i] == 3, result.summary
  _assert_nothing_running(cluster)


def test_sigkill_of_process_0_aborts_the_others_and_the_launcher_says_so():
  # Without the companion (opted out), process 0 hosts the service itself.
  with _start(3, 'allgather', 'small',
              extra_env={multihost.env.COMPANION_SERVICE: '0'}) as cluster:
    _wait_all(cluster, 'LOOPING', range(3))
    cluster.kill(0, signal.SIGKILL)
    result = cluster.wait(timeout=60)
  assert not result.timed_out, result.summary
  assert result.first_failure == 0, result.summary
  assert result.exit_code == 128 + signal.SIGKILL, result.summary
  aborted = []
  for i in (1, 2):
    # JAX's client aborts them about 1 ms after the service's connection
    # drops, before Python runs; this documents it. (A process that raised
    # first, in that millisecond, must at least name process 0.)
    out = result.outputs[i]
    if result.returncodes[i] == -signal.SIGABRT:
      assert ('Terminating process because the JAX distributed service '
              'detected fatal errors') in out, out[-3000:]
      aborted.append(i)
    else:
      assert 'RAISED ProcessFailureError failed=[0]' in out, result.summary
      assert result.returncodes[i] > 0, result.summary
  assert 'hosts the JAX coordination service, died first' in result.summary
  if aborted == [1, 2]:
    assert 'aborted the other processes [1, 2]' in result.summary
  _assert_nothing_running(cluster)


def test_a_killed_peer_is_reported_within_30_s_with_default_settings():
  # Default heartbeat timeout (DRILL_HB empty): the latency from the SIGKILL
  # to each survivor's ProcessFailureError must stay under 30 s.
  with _start(2, 'allgather', 'small',
              extra_env={'DRILL_HB': ''}) as cluster:
    _wait_all(cluster, 'LOOPING', range(2))
    killed_at = time.time()
    cluster.kill(1, signal.SIGKILL)
    result = cluster.wait(timeout=60)
  assert not result.timed_out, result.summary
  _check_survivors(result, 1, killed_at, bound=30.0)
  _assert_nothing_running(cluster)


def test_after_a_timeout_every_process_raises_in_time_and_is_back_in_step():
  # Process 2 arrives 7.5 s late at a collective with a 6 s timeout: the two
  # others time out (naming it) after 6 s, never before, and up to the
  # service's 1 s tick after; process 2 finds they gave up and raises at
  # once, saying how late it came, instead of waiting 6 s more at a barrier
  # nobody else reaches, so the next collectives complete everywhere.
  with _start(3, 'skew', sleeper=2) as cluster:
    result = cluster.wait(timeout=90)
  assert result.ok, result.summary
  for i, out in enumerate(result.outputs):
    m = re.search(r'STEP 0 timeout after=([\d.]+) missing=\[(\d)\]', out)
    assert m, out[-3000:]
    after = float(m.group(1))
    if i == 2:
      assert after < 1.0, (i, m.group(0))  # At once.
    else:
      assert 6.0 <= after < 6.0 + 1.5, (i, m.group(0))
    assert m.group(2) == '2', m.group(0)  # The late one names itself.
    for step in (1, 2):
      assert f'STEP {step} ok [0, 1, 2]' in out, (i, out[-3000:])
  _assert_nothing_running(cluster)


def test_a_late_process_is_named_in_the_timeout_on_every_other_process():
  # Default settings here, to check that failures are reported within 30 s
  # by default (the bound follows JAX's default 10 s heartbeat timeout).
  with _start(3, 'late', sleeper=2,
              extra_env={'DRILL_HB': ''}) as cluster:
    result = cluster.wait(timeout=60)
  assert not result.timed_out, result.summary
  for out in result.outputs:
    bound = float(re.search(r'BOUND ([\d.]+)', out).group(1))
    assert bound <= 30, out
  for i in (0, 1):
    out = result.outputs[i]
    assert 'RAISED CollectiveTimeoutError missing=[2]' in out, out[-3000:]
    assert 'waiting for process(es) [2]' in out, out[-3000:]
    assert result.returncodes[i] == 4, result.summary
  # Process 0, which runs the service, waits at exit for process 1 (which
  # timed out too), but never for process 2, known to be late: it leaves
  # without it, and JAX's client aborts process 2 when the service stops,
  # unless process 2 came and raised before that (a timeout, or a
  # ProcessFailureError saying process 1 has exited).
  assert re.search(r'leaving without waiting for process\(es\) \[2\]',
                   result.outputs[0]), result.outputs[0][-3000:]
  late = result.outputs[2]
  if result.returncodes[2] == -signal.SIGABRT:
    assert 'Terminating process because the JAX distributed service' in late
  else:
    assert ('RAISED CollectiveTimeoutError' in late or
            'RAISED ProcessFailureError failed=[1]' in late and
            'process(es) [1] exited before this collective' in late), late
    assert result.returncodes[2] in (3, 4), result.summary
  _assert_nothing_running(cluster)


def test_a_call_a_peer_left_right_after_its_part_of_completes():
  # Process 1 passes the barrier inside the watched call and exits at once;
  # process 0's call goes on 3 s (Orbax's primary committing alone). That is
  # no failure: process 0's call returns, as does a later one that needs no
  # peer, and both processes exit 0.
  result = launch.launch(program('leaves_after_call'), num_processes=2,
                         timeout=60)
  assert result.ok, result.summary + '\n' + result.outputs[0][-3000:]
  assert 'CALL done; exited: [1]' in result.outputs[0], result.outputs[0]
  assert 'LATER CALL done' in result.outputs[0], result.outputs[0]


def test_with_an_external_service_process_0_is_an_ordinary_failure():
  """When the launcher hosts the coordination service, killing 0 raises too."""
  with held_port() as port:
    service = lowlevel.start_service(
        f'127.0.0.1:{port}', 3, heartbeat_timeout=HEARTBEAT_S,
        shutdown_timeout=10)
    try:
      with _start(3, 'allgather', 'small', port=port,
                  extra_env={multihost.env.EXTERNAL_SERVICE: '1'}) as cluster:
        _wait_all(cluster, 'LOOPING', range(3))
        killed_at = time.time()
        cluster.kill(0, signal.SIGKILL)
        result = cluster.wait(timeout=60)
    finally:
      service.shutdown()
  assert not result.timed_out, result.summary
  _check_survivors(result, 0, killed_at)
  _assert_nothing_running(cluster)
