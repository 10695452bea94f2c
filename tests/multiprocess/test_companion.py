"""Process 0's companion (the default): a crash of process 0 is an ordinary failure, and the companion never outlives the job.

Real controllers started with plain `subprocess.Popen` (no launcher, which
would reap the companion with process 0's process group) and the
environment `multihost.launch` sets; no opt-in. The companion's pid comes
from process 0's output.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import time

from _helpers import alive
from _helpers import clean_env
from _helpers import held_port
from _helpers import kill_alive
from _helpers import program
from _helpers import wait_all
from _helpers import wait_gone
from _helpers import wait_text
import pytest

from multihost import env as mh_env

# Two controllers, but three where process 0's death must be named by
# several others.
N = 2
HEARTBEAT_S = 3
# The watchdog's bound on a loaded 2-core machine (heartbeat + its poll).
BOUND_S = HEARTBEAT_S + 10


# The ports held while a test's processes run (`held_port`).
_HELD = contextlib.ExitStack()


@pytest.fixture(autouse=True)
def _release_ports():
  yield
  _HELD.close()


def _start(tmp_path: pathlib.Path, mode: str, n: int = N, **extra: str):
  port = _HELD.enter_context(held_port())
  procs, logs = [], []
  for i in range(n):
    env = mh_env.controller_env(
        i, num_processes=n, devices_per_process=1, port=port,
        base=clean_env(**{mh_env.HEARTBEAT: str(HEARTBEAT_S), **extra}))
    log = tmp_path / f'p{i}.log'
    with open(log, 'wb') as out:
      procs.append(subprocess.Popen(
          program('companion_life', mode), env=env, stdout=out,
          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
          start_new_session=True))
    logs.append(log)
  return procs, logs


def _companion(logs) -> int:
  line = wait_text(logs[0], 'COMPANION', 120).split('COMPANION ', 1)[1]
  pid, forked = line.split()[:2]
  return int(pid), forked == 'True'


def _no_advice(logs):
  # The service's C++ advice to call WaitAtBarrier (multihost does) is hidden.
  for log in logs:
    assert 'WaitAtBarrier' not in log.read_text(errors='replace')


@pytest.fixture
def cleanup():
  pids = []
  yield pids
  kill_alive(pids)


def test_normal_exit_takes_the_forked_companion_with_it(tmp_path, cleanup):
  procs, logs = _start(tmp_path, 'exit')
  cleanup.extend(p.pid for p in procs)
  pid, forked = _companion(logs)
  cleanup.append(pid)
  assert forked and pid > 0
  assert os.readlink(f'/proc/{pid}/fd/1') == '/dev/null'  # No pipe kept.
  assert wait_all(procs, 120) == [0] * N, [l.read_text()[-2000:] for l in logs]
  assert wait_gone(pid, 2), f'companion {pid} outlived process 0'
  _no_advice(logs)


def test_sigkill_of_process_0_raises_on_the_others_and_the_companion_leaves(
    tmp_path, cleanup):
  procs, logs = _start(tmp_path, 'kill0', n=3)
  cleanup.extend(p.pid for p in procs)
  pid, _ = _companion(logs)
  cleanup.append(pid)
  assert procs[0].wait(120) == -signal.SIGKILL
  killed_at = time.time()
  codes = wait_all(procs[1:], BOUND_S + 10)
  left_at = time.monotonic()
  for i, log in enumerate(logs[1:], 1):
    out = log.read_text(errors='replace')
    assert 'RAISED (0,)' in out, out[-3000:]
    raised = float(out.split('RAISED (0,) at ', 1)[1].split()[0])
    assert raised - killed_at < BOUND_S, out[-3000:]
    assert codes[i - 1] == 3, out[-3000:]
  # No client is connected any more: it leaves at once, not after its grace.
  assert wait_gone(pid, 3), f'companion {pid} outlived the job'
  assert time.monotonic() - left_at < 3


def test_the_whole_job_killed_takes_the_companion_with_it(tmp_path, cleanup):
  procs, logs = _start(tmp_path, 'loop')
  cleanup.extend(p.pid for p in procs)
  pid, _ = _companion(logs)
  cleanup.append(pid)
  for log in logs:
    wait_text(log, 'LOOPING', 120)
  for p in procs:  # By pid, not by process group: the companion is not hit.
    p.send_signal(signal.SIGKILL)
  wait_all(procs, 30)
  assert wait_gone(pid, 3), f'companion {pid} outlived the job'


def test_opting_out_hosts_the_service_in_process_0(tmp_path, cleanup):
  procs, logs = _start(tmp_path, 'exit', **{mh_env.COMPANION_SERVICE: '0'})
  cleanup.extend(p.pid for p in procs)
  assert _companion(logs) == (-1, False)
  assert wait_all(procs, 120) == [0] * N, [l.read_text()[-2000:] for l in logs]
  assert not any(alive(p.pid) for p in procs)
  _no_advice(logs)
