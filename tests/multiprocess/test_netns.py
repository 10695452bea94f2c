"""Simulated hosts (multihost.netns): links, faults, teardown, and JAX controllers across them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from _helpers import program
from _helpers import stop
from _helpers import wait_all
import pytest

from multihost import env as mh_env
from multihost import netns

_OK, _WHY = netns.available()
pytestmark = pytest.mark.skipif(not _OK, reason=_WHY or 'no simulated hosts')

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ours() -> tuple[list[str], list[str]]:
  """Our namespaces in `ip netns list`, and root-namespace links named like ours."""
  spaces = subprocess.run(['ip', 'netns', 'list'], capture_output=True,
                          text=True, timeout=30).stdout
  links = subprocess.run(['ip', '-o', 'link'], capture_output=True,
                         text=True, timeout=30).stdout
  mine = f'{netns.PREFIX}{os.getpid()}-'
  # `ip -o link` lines read 'INDEX: NAME[@PEER]: ...'; only names we would
  # create count (another program's bridge, e.g. libvirt's virbr0, does not).
  names = [l.split(':', 2)[1].strip().split('@')[0]
           for l in links.splitlines() if l.count(':') >= 2]
  return ([l for l in spaces.splitlines() if l.startswith(mine)],
          [n for n in names if n.startswith(netns.PREFIX) or n in ('p0', 'br0')])


def _probe(net: netns.SimulatedHosts, src: int, dst: int) -> str:
  done = subprocess.run(
      net.command(src, program('echo_client', net.address(dst))),
      capture_output=True, text=True, timeout=30)
  assert done.returncode == 0, done.stderr
  return done.stdout.strip()


def _eventually_ok(net: netns.SimulatedHosts, src: int, dst: int) -> bool:
  """Whether a probe succeeds within 10 s (a link coming up may take a moment)."""
  deadline = time.monotonic() + 10
  while True:
    out = _probe(net, src, dst)
    if out.startswith('ok'):
      return True
    if time.monotonic() > deadline:
      print('last probe:', out)
      return False


def _server(net: netns.SimulatedHosts, i: int) -> subprocess.Popen:
  proc = subprocess.Popen(
      net.command(i, program('echo_server', net.address(i))),
      stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == 'listening'
  return proc


def test_hosts_reach_each_other_and_a_cut_link_does_not():
  with netns.SimulatedHosts(2) as net:
    assert net.address(0) != net.address(1)
    server = _server(net, 0)
    try:
      assert _eventually_ok(net, 1, 0)
      net.cut(1)
      out = _probe(net, 1, 0)
      assert out.startswith('fail'), out
      net.restore(1)
      assert _eventually_ok(net, 1, 0)
    finally:
      stop(server)
  assert _ours() == ([], [])


def test_hostname_inside_a_host_is_its_address():
  with netns.SimulatedHosts(2) as net:
    for i in range(2):
      out = subprocess.run(net.command(i, program('hostname')),
                           capture_output=True, text=True, timeout=30).stdout
      assert out.split() == [net.address(i)] * 2


def test_delay_adds_latency_or_says_netem_is_missing():
  with netns.SimulatedHosts(2) as net:
    server = _server(net, 0)
    try:
      try:
        net.delay(1, 100)
      except netns.HostsError as e:
        assert 'sch_netem' in str(e)
        pytest.skip(f'no netem here: {e}')
      out = _probe(net, 1, 0)
      assert out.startswith('ok') and float(out.split()[1]) >= 0.2, out
      net.delay(1, 0)
      out = _probe(net, 1, 0)
      assert out.startswith('ok') and float(out.split()[1]) < 0.2, out
    finally:
      stop(server)


def test_teardown_when_the_body_raises_and_processes_inside_are_killed():
  with pytest.raises(ZeroDivisionError):
    with netns.SimulatedHosts(3) as net:
      proc = subprocess.Popen(net.command(2, ['sleep', '600']))
      assert _ours()[0]
      raise ZeroDivisionError  # The body fails.
  assert proc.wait(timeout=30) == -signal.SIGKILL
  assert _ours() == ([], [])


def test_leftovers_of_a_dead_run_are_deleted():
  # A child creates hosts and is SIGKILLed: no __exit__, no atexit.
  child = subprocess.Popen(program('abandoned_hosts'), stdout=subprocess.PIPE,
                           text=True, env={**os.environ, 'PYTHONPATH': _ROOT})
  name = child.stdout.readline().strip()
  os.kill(child.pid, signal.SIGKILL)
  child.wait(timeout=30)
  listed = subprocess.run(['ip', 'netns', 'list'], capture_output=True,
                          text=True, timeout=30).stdout
  assert f'{name}-sw' in listed
  deleted = netns.cleanup_stale()
  assert f'{name}-sw' in deleted and f'{name}-h1' in deleted
  listed = subprocess.run(['ip', 'netns', 'list'], capture_output=True,
                          text=True, timeout=30).stdout
  assert name not in listed


# --- JAX controllers, one per simulated host. ------------------------------

def _free_port() -> int:
  # Any port is free inside fresh namespaces; vary it between runs anyway.
  return 20000 + os.getpid() % 20000


def _start_controllers(net, n, name, tmp_path, extra_env=None, args=()):
  """tests/programs/`name`.py on hosts 0..n-1, logging to tmp_path."""
  port = _free_port()
  procs = []
  for i in range(n):
    env = mh_env.controller_env(i, num_processes=n, devices_per_process=1,
                                port=port, host=net.address(0))
    env['PYTHONPATH'] = _ROOT
    env.update(extra_env or {})
    log = open(tmp_path / f'controller{i}.log', 'w')
    procs.append(subprocess.Popen(net.command(i, program(name, *args)),
                                  env=env, stdout=log,
                                  stderr=subprocess.STDOUT))
  return procs, port


def _logs(tmp_path, n):
  return [(tmp_path / f'controller{i}.log').read_text() for i in range(n)]


# At 4 hosts (rings and chains of more than two; a 2-host run of the same
# program asserts nothing more, and 2-host collectives run in
# test_netns_faults.py).
@pytest.mark.parametrize('n', [4])
def test_jax_controllers_across_simulated_hosts(tmp_path, n):
  with netns.SimulatedHosts(n) as net:
    procs, port = _start_controllers(net, n, 'netns_controller', tmp_path)
    codes = wait_all(procs, 300)
    logs = _logs(tmp_path, n)
    assert codes == [0] * n, '\n\n'.join(l[-3000:] for l in logs)
    reports = [json.loads(l.split('RESULT ', 1)[1].splitlines()[0])
               for l in logs]
    # The coordination service listens on host 0's address only.
    a, b, c, d = (int(x) for x in net.address(0).split('.'))
    want = f'{d:02X}{c:02X}{b:02X}{a:02X}:{port:04X}'
    listening = reports[0]['listening']
    # (tcp6 shows an IPv4-mapped address: ::ffff:a.b.c.d.)
    on_port = [s.replace('0000000000000000FFFF0000', '')
               for s in listening if s.endswith(f':{port:04X}')]
    assert on_port == [want], listening
    # The striped broadcasts ran over the links, each host holding a lane-1
    # link to each neighbour in the chain.
    for r in reports:
      assert r['links'], r
      me = r['me']
      assert r['lane_links'] == sorted(
          str(((me + d) % n, 1)) for d in (1, -1)), r
      # Across hosts the local socket's name is refused: links are TCP.
      assert r['families'] == ['AF_INET'], r
    print({r['me']: round(r['allgather_64MiB_s'], 3) for r in reports})
  assert _ours() == ([], [])


# --- Link cuts during a barrier loop (heartbeat timeout 5 s). ---------------

def _cut_during_loop(tmp_path, n, victim, cut_s, loop_s):
  """Runs the loop on n hosts, cuts `victim` for cut_s (or until all exited); (codes, logs, exits)."""
  with netns.SimulatedHosts(n) as net:
    procs, _ = _start_controllers(net, n, 'barrier_loop', tmp_path,
                                  {mh_env.HEARTBEAT: '5'}, [str(loop_s)])
    deadline = time.monotonic() + 120
    while not all('LOOP' in l for l in _logs(tmp_path, n)):
      assert time.monotonic() < deadline and all(
          p.poll() is None for p in procs), _logs(tmp_path, n)
      time.sleep(0.1)
    time.sleep(1)
    net.cut(victim)
    cut_at = time.monotonic()
    exits = {}
    while time.monotonic() - cut_at < cut_s and len(exits) < n:
      for i, p in enumerate(procs):
        if i not in exits and p.poll() is not None:
          exits[i] = time.monotonic() - cut_at
      time.sleep(0.05)
    net.restore(victim)
    codes = wait_all(procs, loop_s + 60)
    return codes, _logs(tmp_path, n), exits


def test_a_1s_cut_fails_nothing(tmp_path):
  # The loop runs 5 s: the cut (1 s after LOOP, for 1 s) and 3 s after it.
  codes, logs, exits = _cut_during_loop(tmp_path, 2, 1, 1, 5)
  assert codes == [0, 0], '\n\n'.join(l[-3000:] for l in logs)
  assert not exits
  for log in logs:
    assert 'DONE' in log


def test_an_8s_cut_aborts_the_cut_off_side_and_names_it_on_the_other(tmp_path):
  codes, logs, exits = _cut_during_loop(tmp_path, 2, 1, 8, 30)
  # The coordinator's side raises in Python, naming the lost process.
  assert codes[0] == 3, logs[0][-3000:]
  assert 'ERROR ProcessFailureError: [process=0]' in logs[0]
  assert 'process(es) [1] failed' in logs[0]
  # The side cut off from the coordinator is aborted by JAX's client, with
  # no Python code run, within the heartbeat timeout.
  assert codes[1] == -signal.SIGABRT, logs[1][-3000:]
  assert 'Terminating process because the JAX distributed service' in logs[1]
  assert 1 in exits and exits[1] < 8, exits
