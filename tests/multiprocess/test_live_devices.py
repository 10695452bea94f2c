"""multihost.live_devices and a ProcessFailureError that JAX's handlers catch.

The drills run a program written after JAX's fault-tolerance docs
(docs/_static/fault_tolerance/live_devices.py), with only the import swapped:
a loop of `with live_devices(jax.devices()) as devices:` blocks, each
running a jitted sum on the mesh of the yielded devices, in real controllers
under `multihost.launch`; one of them is SIGKILLed between blocks, or during
one. Every survivor must raise ProcessFailureError from the same block,
caught as JAX's class, with `failed_devices` = the dead process's devices,
and then go on, on the live devices.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import textwrap
import time

import jax
from jax.experimental import multihost_utils as jax_mhu
import pytest
from topologies import topologies

import multihost
from multihost import launch
from multihost import netns

HEARTBEAT_S = 3
# The watchdog's bound (heartbeat + 2 polls + 1 s) plus a barrier window
# (1-2 s, the service's deadline granularity); generous for a loaded machine.
DETECTION_BOUND_S = HEARTBEAT_S + 7.0
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PROGRAM = textwrap.dedent('''
    """JAX's live_devices example, after `import multihost` replaced it."""
    import logging
    import sys
    import threading
    import time

    import multihost
    from multihost import live_devices

    MODE, VICTIM, BLOCKS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    multihost.initialize(heartbeat_timeout_seconds=float(sys.argv[4]))
    seen = threading.Event()  # live_devices logged a death during a block


    class _Seen(logging.Handler):

      def emit(self, record):
        if 'died during block' in record.getMessage():
          seen.set()


    logging.getLogger('absl').addHandler(_Seen())
    import jax  # noqa: E402
    import jax.numpy as jnp  # noqa: E402
    from jax.experimental import multihost_utils  # noqa: E402

    me = jax.process_index()
    print('LOCAL', sorted(d.id for d in jax.local_devices()), flush=True)
    ok = 0
    block = 0
    while ok < BLOCKS:
      if me == VICTIM and MODE == 'between' and block == 3:
        print(f'BETWEEN at={time.time():.3f}', flush=True)
        time.sleep(600)  # Killed here, between two blocks.
      try:
        with live_devices(jax.devices()) as devices:
          n = len(devices)
          mesh = jax.make_mesh((n,), ('i',), devices=devices)
          sharding = jax.NamedSharding(mesh, jax.P('i'))
          x = jax.device_put(jnp.arange(n), sharding)
          total = int(jax.jit(jnp.sum)(x))
          assert total == n * (n - 1) // 2, (total, n)
          if block == 1 and me == 1:
            raise KeyError('a body that raises on process 1 only')
          if MODE == 'during' and block == 3:
            if me == VICTIM:
              print(f'DURING at={time.time():.3f}', flush=True)
              time.sleep(600)  # Killed here, inside a block.
            if me == 1:  # Still in the body when the death is seen.
              seen.wait(float(sys.argv[4]) + 5)
      except multihost_utils.ProcessFailureError as e:  # JAX's class.
        print(f'BLOCK {block} RAISED ProcessFailureError '
              f'failed={list(e.failed)} '
              f'failed_devices={sorted(d.id for d in e.failed_devices)} '
              f'at={time.time():.3f} message={e}', flush=True)
      except Exception as e:  # noqa: BLE001
        print(f'BLOCK {block} RAISED {type(e).__name__} message={e}',
              flush=True)
      else:
        ok += 1
        print(f'BLOCK {block} ok devices={[d.id for d in devices]} '
              f'sum={total}', flush=True)
      block += 1
    print('DONE', flush=True)
''')


def _launch(tmp_path, mode, *, num_processes=3, devices_per_process=2,
            victim=2, blocks=6, hosts=None):
  script = tmp_path / 'live.py'
  script.write_text(_PROGRAM)
  return launch.Controllers(
      [sys.executable, str(script), mode, str(victim), str(blocks),
       str(HEARTBEAT_S)],
      num_processes=num_processes, devices_per_process=devices_per_process,
      env={'PYTHONPATH': _ROOT}, grace_period=90, hosts=hosts)


def _blocks(out: str) -> dict[int, str]:
  """Block number -> its line's text after 'BLOCK n '."""
  return {int(m.group(1)): m.group(2)
          for m in re.finditer(r'^BLOCK (\d+) (.*)$', out, re.M)}


def _drill(tmp_path, mode, *, hosts=None):
  """Runs the program, kills process 2 where `mode` says; returns (result, killed_at)."""
  with _launch(tmp_path, mode, hosts=hosts) as cluster:
    word = 'BETWEEN' if mode == 'between' else 'DURING'
    cluster.wait_for_output(2, word, timeout=120)
    time.sleep(0.3)  # The others are now at the next barrier.
    killed_at = time.time()
    cluster.kill(2, signal.SIGKILL)
    result = cluster.wait(timeout=120)
  assert not result.timed_out, result.summary
  return result, killed_at


def _local_ids(out: str) -> list[int]:
  return [int(i) for i in re.search(r'LOCAL \[(.*?)\]', out).group(1).split(
      ', ')]


def _check_survivors(result, killed_at):
  assert result.returncodes[2] == -signal.SIGKILL, result.summary
  ids = [_local_ids(out) for out in result.outputs]
  everyone = f'ok devices={sorted(sum(ids, []))} sum=15'
  live = f'ok devices={sorted(ids[0] + ids[1])} sum=6'
  raised_in = set()
  for i in (0, 1):
    out = result.outputs[i]
    assert result.returncodes[i] == 0, (i, result.summary, out[-3000:])
    assert 'DONE' in out, out[-3000:]
    blocks = _blocks(out)
    # Blocks 0, 2 run on every device; block 1 raised everywhere (process
    # 1's body raised); process 2 is killed after block 2.
    for b in (0, 2):
      assert blocks[b] == everyone, (i, b, blocks[b])
    if i == 1:
      assert blocks[1].startswith('RAISED KeyError'), blocks[1]
    else:
      assert blocks[1].startswith('RAISED MultihostError'), blocks[1]
      assert 'process(es) [1]' in blocks[1] and 'KeyError' in blocks[1]
    failures = {b: t for b, t in blocks.items() if 'ProcessFailureError' in t}
    assert len(failures) == 1, (i, failures)
    (block, text), = failures.items()
    raised_in.add(block)
    m = re.match(r'RAISED ProcessFailureError failed=\[(.*?)\] '
                 r'failed_devices=\[(.*?)\] at=([\d.]+) message=(.*)', text)
    assert m, text
    assert m.group(1) == '2', text
    assert m.group(2) == ', '.join(map(str, ids[2])), (text, ids[2])
    assert 'process(es) [2]' in m.group(4), text
    latency = float(m.group(3)) - killed_at
    assert 0 < latency < DETECTION_BOUND_S, (i, latency, text)
    # Then on, on the 4 live devices: the blocks after the failure all pass.
    after = [t for b, t in sorted(blocks.items()) if b > block]
    assert len(after) >= 3, (i, after)
    for t in after:
      assert t == live, (i, t)
  assert len(raised_in) == 1, raised_in  # The same block everywhere.
  return raised_in.pop()


def test_a_peer_killed_between_blocks_fails_the_next_block_at_its_start(
    tmp_path):
  result, killed_at = _drill(tmp_path, 'between')
  block = _check_survivors(result, killed_at)
  assert block == 3, block
  for i in (0, 1):
    assert 'this block did not start' in _blocks(result.outputs[i])[3]


def test_a_peer_killed_during_a_block_fails_that_block_at_its_end(tmp_path):
  result, killed_at = _drill(tmp_path, 'during')
  block = _check_survivors(result, killed_at)
  assert block == 3, block
  for i in (0, 1):
    text = _blocks(result.outputs[i])[3]
    assert 'failed during this block' in text, text
  # Process 1 was still in the body when the watchdog saw the death: it
  # says that a device collective there would never return. Process 0 was
  # already at the block's end.
  assert 'process(es) [2] died during block 3' in result.outputs[1]
  assert 'died during block' not in result.outputs[0]


_OK, _WHY = netns.available()


@pytest.mark.skipif(not _OK, reason=_WHY or 'no simulated hosts')
def test_a_peer_killed_on_another_netns_host(tmp_path):
  result, killed_at = _drill(tmp_path, 'between', hosts='netns')
  assert _check_survivors(result, killed_at) == 3


# --- Late and missing processes (in the pytest plugin's controllers) --------


@topologies('3x1', timeout=240)
def test_a_late_process_joins_and_one_that_never_comes_is_named(topology):
  pid = jax.process_index()
  late = 2.5
  # Late at the exit: the others' barrier windows expire and are retried; the
  # late process joins the barrier they wait at, at once.
  start = time.monotonic()
  with multihost.live_devices(jax.devices()) as devices:
    if pid == 2:
      time.sleep(late)
  took = time.monotonic() - start
  assert devices == jax.devices(), devices
  assert took < late + 0.8, took
  # Later than the timeout at the entry: the others name it and where it is;
  # it finds that they gave up and raises at once.
  start = time.monotonic()
  if pid == 2:
    time.sleep(5)
    with pytest.raises(multihost.CollectiveTimeoutError, match='arrived late'):
      with multihost.live_devices(jax.devices(), timeout=2):
        pass
    assert time.monotonic() - start < 5 + 2.5
  else:
    with pytest.raises(multihost.CollectiveTimeoutError) as info:
      with multihost.live_devices(jax.devices(), timeout=2):
        pass
    # The timeout, the service's deadline tick (up to 1 s), and asking the
    # late process where it is (up to 1.5 s).
    assert time.monotonic() - start < 2 + 4.0
    assert info.value.missing == (2,), str(info.value)
    message = str(info.value)
    assert 'live_devices: timed out' in message, message
    assert 'Where they are: process 2: main thread in' in message, message
  # In step again.
  with multihost.live_devices(jax.devices()) as devices:
    assert devices == jax.devices()
  # Blocks of a subset of the processes: the others do not take part, nor
  # count them, and are in step for the next block of everyone.
  pair = [d for d in jax.devices() if d.process_index < 2]
  if pid < 2:
    for _ in range(3):
      with multihost.live_devices(pair, timeout=20) as devices:
        assert devices == pair
  with multihost.live_devices(jax.devices(), timeout=20) as devices:
    assert devices == jax.devices()


# --- One process -----------------------------------------------------------


def test_one_process_yields_the_devices_sorted_and_re_raises():
  devices = jax.devices()
  with multihost.live_devices(devices[::-1] + devices[:1]) as live:
    assert live == sorted(devices, key=lambda d: d.id)
  with pytest.raises(KeyError, match='body'):
    with multihost.live_devices(devices):
      raise KeyError('body')
  with pytest.raises(ValueError, match='No devices provided'):
    with multihost.live_devices([]):
      pass


def test_process_failure_error_is_jax_class_with_failed_devices():
  error = multihost.ProcessFailureError('gone', operation='op', failed=[0])
  assert isinstance(error, jax_mhu.ProcessFailureError)
  assert isinstance(error, multihost.MultihostError)
  assert str(error) == 'gone' and error.failed == (0,)
  # By default, every device of the failed processes.
  assert error.failed_devices == set(jax.devices())
  assert multihost.ProcessFailureError('none').failed_devices == set()
  some = multihost.ProcessFailureError(
      'x', failed=[0], failed_devices=jax.devices()[:1])
  assert some.failed_devices == {jax.devices()[0]}
  with pytest.raises(jax_mhu.ProcessFailureError):
    raise error
