"""Where is everyone: a process stuck in user code is named, with its stack and last collective.

Real controllers (`python -m multihost.launch`), one stuck in a named Python
function (`stuck_in_data_loader`, in time.sleep) while the others wait at a
barrier and then at an all-gather. Each waiting process logs a stall line
before its timeout and then raises a `CollectiveTimeoutError` that names the
stuck process, its function and its last collective. The run (P=4, stuck
process 2) also calls `multihost.where()` from process 0 and sends SIGUSR1 to
the launcher while process 2 is stuck (every controller prints where it is
and keeps running); it ends cleanly. A second run
freezes a process (SIGSTOP) during 256 MiB all-gathers: the other's timeout,
raised by the data plane, still says where the frozen one is.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

from _helpers import program

from multihost import env as env_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 4.0  # of the all-gathers that a frozen process times out
# The stuck program's collectives time out after STUCK_TIMEOUT_S; a stall
# line comes STALL_S into each (the fast path takes the first 1 s), a second
# before the timeout.
STUCK_TIMEOUT_S = 3.0
STALL_S = 2.0

def _run(tmp_path, num_processes: int, stuck: int, mode: str,
         on_stuck=None) -> tuple[int, str]:
  """Runs tests/programs/stuck.py under the launcher; calls on_stuck(launcher) at the first STUCK line."""
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env.pop(env_lib.STALL_REPORT_AFTER, None)
  proc = subprocess.Popen(
      [sys.executable, '-m', 'multihost.launch',
       f'--num_processes={num_processes}', '--devices_per_process=1',
       '--timeout=100', '--',
       *program('stuck', stuck, STUCK_TIMEOUT_S, STALL_S, mode)],
      cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True, start_new_session=True)
  lines = []

  def pump():
    fired = False
    for line in proc.stdout:
      lines.append(line)
      if not fired and on_stuck is not None and 'STUCK' in line:
        fired = True
        threading.Timer(0.7, on_stuck, args=(proc,)).start()

  reader = threading.Thread(target=pump, daemon=True)
  reader.start()
  try:
    code = proc.wait(timeout=120)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  reader.join(10)
  return code, ''.join(lines)


def _lines(output: str, index: int, marker: str) -> list[str]:
  return [l for l in output.splitlines()
          if l.startswith(f'[p{index}]') and marker in l]


def _check_waiters(output: str, num_processes: int, stuck: int) -> None:
  for p in range(num_processes):
    if p == stuck:
      continue
    barrier = _lines(output, p, 'BARRIER-ERROR')
    assert len(barrier) == 1, output
    # The barrier is named; the stuck process is named with its function
    # (file:line) and its last collective.
    assert "sync_global_devices('before step 1')" in barrier[0], barrier[0]
    assert f'process {stuck}: main thread in stuck_in_data_loader (' in (
        barrier[0]), barrier[0]
    assert re.search(r'stuck\.py:\d+\)', barrier[0]), barrier[0]
    assert ("last completed collective: sync_global_devices('warm up')"
            in barrier[0]), barrier[0]
    gather = _lines(output, p, 'GATHER-ERROR')
    assert len(gather) == 1, output
    assert f'process {stuck}: main thread in stuck_in_data_loader (' in (
        gather[0]), gather[0]
    assert 'last completed collective: process_allgather (call' in (
        gather[0]), gather[0]
    # One stall line per collective, before the timeout.
    stalls = _lines(output, p, 'still waiting after')
    assert len(stalls) == 2, output
    assert 'stuck_in_data_loader' in stalls[0] and 'stuck_in_data_loader' in (
        stalls[1]), stalls
    assert "sync_global_devices('before step 1')" in stalls[0], stalls[0]
    lines = [l for l in output.splitlines() if l.startswith(f'[p{p}]')]
    order = [i for i, l in enumerate(lines)
             if 'still waiting after' in l or '-ERROR ' in l]
    kinds = ['stall' if 'still waiting' in lines[i] else 'error'
             for i in order]
    assert kinds == ['stall', 'error', 'stall', 'error'], kinds
  for p in range(num_processes):
    assert _lines(output, p, 'DONE'), output
    straggler = _lines(output, p, 'STRAGGLER')
    assert len(straggler) == 1, output
    assert f'STRAGGLER {stuck} straggler: process {stuck} came last' in (
        straggler[0]), straggler[0]


def test_stuck_process_at_four_processes_where_and_sigusr1(tmp_path):
  sent = []

  def on_stuck(launcher):
    sent.append(time.monotonic())
    os.kill(launcher.pid, signal.SIGUSR1)

  code, output = _run(tmp_path, 4, 2, 'where', on_stuck=on_stuck)
  assert code == 0, output
  assert sent, output
  _check_waiters(output, 4, 2)
  # multihost.where() from process 0 (its own output's lines only: the
  # others print their SIGUSR1 reports too).
  report = '\n'.join(l for l in output.split('WHERE-REPORT', 1)[1].splitlines()
                     if l.startswith('[p0]'))
  for p in range(4):
    assert f'[process={p}] where: pid' in report, report
  assert re.search(r'\[process=2\]\s+\S*stuck\.py:\d+ stuck_in_data_loader',
                   report), report
  head = [l for l in report.splitlines() if '[process=1] where: pid' in l]
  assert "now waiting in sync_global_devices('before step 1')" in head[0]
  # SIGUSR1: every controller printed where it is, and went on (DONE, 0).
  # (Process 1: process 0 may still be in its where() call.)
  for p in range(4):
    assert len(_lines(output, p, f'[process={p}] where (on SIGUSR1)')) == 1, (
        output)
  stuck = _lines(output, 2, '[process=2] where (on SIGUSR1)')
  waiting = _lines(output, 1, '[process=1] where (on SIGUSR1)')
  assert 'now waiting in' not in stuck[0], stuck[0]
  assert "now waiting in sync_global_devices('before step 1')" in (
      waiting[0]), waiting[0]
  frames = _lines(output, 2, 'stuck_in_data_loader')
  assert any(re.search(r'stuck\.py:\d+ stuck_in_data_loader', l)
             for l in frames), output


def test_a_transfer_timeout_says_where_the_peer_is():
  # Nearly all of each call is the 256 MiB transfer, after the agreement, so
  # the freeze lands there: the waiting process's timeout comes from the
  # data plane, and must still say where the peer is (frozen: not answering).
  from multihost import launch  # pylint: disable=import-outside-toplevel
  with launch.Controllers(
      program('big_allgathers', TIMEOUT_S), num_processes=2,
      env={'PYTHONPATH': str(ROOT), env_lib.HEARTBEAT: '60'},
      grace_period=5, kill_wait=1) as cluster:
    for i in range(2):
      assert cluster.wait_for_output(i, 'LOOP', timeout=120), cluster.outputs
    cluster.kill(1, signal.SIGSTOP)
    named = cluster.wait_for_output(0, 'ERROR', timeout=TIMEOUT_S + 20)
    out0 = cluster.output(0)
    cluster.kill(1, signal.SIGKILL)
    cluster.wait(60)
  assert named, out0[-3000:]
  error = out0.split('ERROR ', 1)[1]
  assert error.startswith('CollectiveTimeoutError'), error[:2000]
  assert 'process 1' in error and (
      'Where they are: process 1: not answering' in error), error[:2000]
