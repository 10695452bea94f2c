"""Both data planes for large payloads at an odd process count, a blocked data-plane port, lanes that differ across processes, and local links between processes on one host."""

from __future__ import annotations

import json
import os
import re
import signal

from _helpers import program
import pytest

from multihost import env as env_lib
from multihost import launch


# With local links (one host) the broadcasts go through the source's stage;
# without, at 5 processes a broadcast of one stripe (3 MiB) goes down a
# binomial tree with processes in its middle (at 3 the source sends to
# both), and larger ones down the lanes' chains.
@pytest.mark.parametrize('transport,lanes,count,local', [
    ('tcp', '', 2, '1'), ('tcp', '', 3, '1'), ('tcp', '3', 3, '0'),
    ('device', '', 3, '1'),
    ('tcp', '', 5, '1'), ('tcp', '', 5, '0')])
def test_large_payloads_over_each_transport(transport, lanes, count, local):
  result = launch.launch(program('bulk_transfers'), num_processes=count,
                         devices_per_process=1, timeout=120,
                         env={env_lib.TRANSPORT: transport,
                              env_lib.TCP_LANES: lanes,
                              env_lib.LOCAL_LINKS: local})
  assert result.ok, result.summary + '\n'.join(result.outputs)
  assert all('TRANSPORT OK' in out for out in result.outputs)
  if transport == 'tcp' and local == '1':
    assert all(f'STAGED {count - 1} links' in out for out in result.outputs)
  elif transport == 'tcp':
    assert all(f'LANES {lanes or 2}' in out for out in result.outputs)


def test_default_source_broadcasts_down_the_tree_answer_with_their_payload():
  """Over TCP links at 5 processes (each reno where the host's default congestion control is bbr), 1 MiB default-source broadcasts go down the tree; where the processes agree in a star (this host has no more cores than 5), process 0 sends each of its 3 children one frame a call, the payload, and no answer; a differing shape is named on every process, and differing timeouts still return the bytes."""
  result = launch.launch(program('relayed_broadcasts'), num_processes=5,
                         devices_per_process=1, timeout=120,
                         env={env_lib.LOCAL_LINKS: '0'})
  assert result.ok, result.summary + '\n'.join(result.outputs)
  assert all('RELAYED OK' in out for out in result.outputs)
  star = (os.cpu_count() or 1) <= 5
  assert all(f'STAR {star}' in out for out in result.outputs), result.outputs
  # Its links' congestion control: reno where the host's default paces
  # (bbr), else the host's default.
  with open('/proc/sys/net/ipv4/tcp_congestion_control') as f:
    default = f.read().strip()
  want = 'reno' if default.startswith('bbr') else default
  assert all(f'CONGESTION {want}\n' in out for out in result.outputs), [
      out[-600:] for out in result.outputs]
  if star:  # the payload alone to its children 4, 2 and 1
    assert 'FRAMES 3.0' in result.outputs[0], result.outputs[0][-2000:]


def test_a_process_without_a_stage_gets_the_bytes_themselves():
  """On one host, process 1 cannot make a stage: its links hold none, the others' do, and broadcasts from every source (one piece, and three of an odd size) still return the source's bytes everywhere."""
  result = launch.launch(program('stage_missing'), num_processes=3,
                         devices_per_process=1, timeout=120)
  assert result.ok, result.summary + '\n'.join(result.outputs)
  assert all('STAGE-MISSING OK' in out for out in result.outputs)


def test_a_receiver_frozen_in_a_staged_broadcast_times_out_every_other():
  """On one host, process 1 freezes between copying a piece out of process 0's stage and releasing its slot: process 0 times out waiting for the release and names process 1 as not answering; process 2, waiting for the next piece with a later deadline, sees process 0 close its link and times out in its own time, not the watchdog's (60 s here). (Their exit then waits for the frozen process, killed by the test: not checked here.)"""
  timeout, later = 4.0, 2.0
  with launch.Controllers(program('stage_stall', timeout, later),
                          num_processes=3, env={env_lib.HEARTBEAT: '60'},
                          grace_period=5, kill_wait=1) as cluster:
    for i in (0, 2):
      assert cluster.wait_for_output(i, 'RAISED', timeout=120), (
          cluster.outputs)
    cluster.kill(1, signal.SIGKILL)
    result = cluster.wait(120)
  assert not result.timed_out, result.summary
  for i, missing, limit in ((0, 1, timeout), (2, 0, timeout + later)):
    out = result.outputs[i]
    m = re.search(r'RAISED CollectiveTimeoutError missing=\[(\d)\] '
                  r'after=([\d.]+): (.*)', out)
    assert m, out[-3000:]
    assert int(m.group(1)) == missing, m.group(0)
    # (process 0 then asks where process 1 is: 1.5 s more)
    assert timeout <= float(m.group(2)) < limit + 3.0, m.group(0)
  assert 'Where they are: process 1: not answering' in result.outputs[0], (
      result.outputs[0][-3000:])
  assert 'its connection broke' in result.outputs[2], result.outputs[2][-3000:]
  assert 'COMPLETED' not in result.outputs[1], result.outputs[1][-3000:]


@pytest.mark.parametrize('count', [2, 3])
def test_a_source_with_a_spare_core_copies_its_result_aside(count):
  """With `Plane.spare_cores` a broadcast's source copies its own result on the copier thread (at 2 processes down the chain, at 3 down the tree, and through its stage at both): the same results everywhere, the source's its own."""
  result = launch.launch(program('source_copy_aside'), num_processes=count,
                         devices_per_process=1, timeout=120)
  assert result.ok, result.summary + '\n'.join(result.outputs)
  assert all('COPY-ASIDE OK' in out for out in result.outputs)


def test_a_blocked_data_plane_port_says_how_to_get_through():
  # Process 1's data-plane port refuses connections (see the program). The
  # processes leave after the error within the watchdog's detection bound:
  # a 3 s heartbeat keeps that wait short (nothing here depends on it).
  result = launch.launch(program('blocked_port'), num_processes=2,
                         devices_per_process=1, timeout=120,
                         # (TCP's port: links on one host are local)
                         env={env_lib.HEARTBEAT: '3',
                              env_lib.LOCAL_LINKS: '0'})
  assert all('BLOCKED-PORT OK' in out for out in result.outputs), (
      result.summary + '\n'.join(result.outputs))


@pytest.mark.parametrize('local', ['on', '0'])
def test_processes_on_one_host_link_over_local_sockets_unless_turned_off(
    local):
  """Real controllers on one host: every link (both lanes) is a Unix domain socket, and lane 0's holds the peer's stage; with $MULTIHOST_LOCAL_LINKS=0, TCP and no stage."""
  env = {} if local == 'on' else {env_lib.LOCAL_LINKS: local}
  result = launch.launch(program('link_families'), num_processes=2,
                         devices_per_process=1, timeout=120, env=env)
  assert result.ok, result.summary + '\n'.join(result.outputs)
  want = 'AF_UNIX' if local == 'on' else 'AF_INET'
  for me, out in enumerate(result.outputs):
    families = json.loads(out.split('FAMILIES ', 1)[1].splitlines()[0])
    peer = 1 - me
    assert families == {str(peer): want, str((peer, 1)): want}, families
    stages = json.loads(out.split('STAGES ', 1)[1].splitlines()[0])
    assert stages == {str(peer): local == 'on', str((peer, 1)): False}, stages


def test_lanes_that_differ_are_a_consistency_error_at_once():
  """$MULTIHOST_TCP_LANES differing (2 vs 3) is named on every process before any data moves, not a timeout."""
  result = launch.launch(program('lanes_differ'), num_processes=2,
                         devices_per_process=1, timeout=60)
  assert result.ok, result.summary + '\n'.join(result.outputs)
  for out in result.outputs:
    line = next(l for l in out.splitlines() if 'CONSISTENCY' in l or
                'NO ERROR' in l)
    assert 'MULTIHOST_TCP_LANES differs across processes' in line, line
    assert float(line.split('after ')[1].split(' s')[0]) < 10, line
