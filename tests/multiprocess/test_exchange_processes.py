"""multihost.exchange in real controllers: patterns checked byte for byte, no byte to a process that did not ask for it (the kernel's counts per link), a mismatch raised everywhere, a dead or missing peer named."""

from __future__ import annotations

import re
import signal

from _helpers import program
import pytest

from multihost import env as env_lib
from multihost import launch


@pytest.mark.parametrize('count,local', [(3, '0'), (4, '1')])
def test_each_payload_reaches_its_destination_only(count, local):
  # An object limit of 100 kB: the ring's arrays are 3 x that, out of band.
  result = launch.launch(program('exchange_pattern'), num_processes=count,
                         devices_per_process=1, timeout=120,
                         env={env_lib.LOCAL_LINKS: local,
                              env_lib.MAX_OBJECT_BYTES: '100000'})
  assert result.ok, result.summary + '\n'.join(result.outputs)
  assert all('EXCHANGE OK' in out for out in result.outputs)
  if local == '0':  # Over TCP links the kernel counted every link's bytes.
    assert all('COUNTED' in out for out in result.outputs), result.outputs


def test_a_dead_peer_raises_process_failure_naming_it():
  result = launch.launch(program('exchange_failures', 'dies'),
                         num_processes=3, devices_per_process=1, timeout=120)
  assert result.returncodes[2] == -signal.SIGKILL, result.summary
  for p in (0, 1):
    named = re.search(r'RAISED \(([\d, ]*)\)', result.outputs[p])
    assert named, result.outputs[p][-2000:]
    failed = {int(n) for n in named.group(1).split(',') if n.strip()}
    # Process 2 is named; the other survivor too where it had already
    # left (exit 3, after its own error) when this one's error was made.
    assert 2 in failed and failed <= {0, 1, 2} - {p}, result.outputs[p]
    assert result.returncodes[p] == 3, result.summary


def test_a_missing_peer_times_out_naming_it():
  result = launch.launch(program('exchange_failures', 'late'),
                         num_processes=3, devices_per_process=1, timeout=120)
  for p in (0, 1):
    assert 'TIMEOUT' in result.outputs[p], result.outputs[p][-2000:]
    assert 'waiting for process(es) [2]' in result.outputs[p]
