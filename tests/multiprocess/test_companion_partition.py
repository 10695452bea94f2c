"""Nothing outlives a partitioned job: three controllers on three simulated hosts loop 64 MiB all-gathers, host 2 is cut off or frozen (SIGSTOP), and process 0's companion (which hosts the coordination service) leaves within heartbeat + 10 s of process 0's exit (docs/failures.md), well inside 25 s.

The controllers are started with plain `subprocess.Popen` in the hosts'
namespaces, no launcher (which would reap the companion with process 0's
process group), and a Python thread runs in each before
`multihost.initialize()`, so process 0's companion is the program form
(`python -m multihost._src.runtime.companion`). Processes 0 and 1 raise
`ProcessFailureError` naming process 2 and exit; with the link cut,
process 2 is aborted by JAX's client once its heartbeats fail, so no
process of the job remains 25 s after process 0 has exited. (A frozen
process cannot leave by itself: the test kills it.)
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time

from _helpers import alive
from _helpers import clean_env
from _helpers import kill_alive
from _helpers import program
from _helpers import wait_text
import pytest

from multihost import env as mh_env
from multihost import netns

_OK, _WHY = netns.available()
pytestmark = pytest.mark.skipif(not _OK, reason=_WHY or 'no simulated hosts')

_N = 3
_PORT = 8476
_HEARTBEAT_S = 5
# The bound: nothing of the job 25 s after process 0 has exited
# (the companion's own: heartbeat + 10 s).
_GONE_WITHIN_S = 25.0


def _gone_within(pids, timeout):
  deadline = time.monotonic() + timeout
  while any(alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  return [p for p in pids if alive(p)]


# Process 0 leaves by `os._exit` (as a crash, or a process leaving with 75
# after a peer's loss does): no exit sequence stops the companion, which
# must leave by itself. (After a normal exit or an uncaught error, process
# 0 stops it before it exits.)
@pytest.mark.parametrize('fault,end', [('cut', 'os_exit'),
                                       ('freeze', 'os_exit')])
def test_the_companion_leaves_after_process_0_whatever_happened_to_a_peer(
    tmp_path, fault, end):
  procs, logs, companion = [], [], None
  with netns.SimulatedHosts(_N) as net, contextlib.ExitStack() as stack:
    stack.callback(lambda: kill_alive(
        [p.pid for p in procs] + ([companion] if companion else [])))
    for i in range(_N):
      env = mh_env.controller_env(
          i, num_processes=_N, devices_per_process=1, port=_PORT,
          host=net.address(0),
          base=clean_env(**{mh_env.HEARTBEAT: str(_HEARTBEAT_S),
                            mh_env.COMPANION_SERVICE: '1'}))
      logs.append(tmp_path / f'p{i}.log')
      with open(logs[-1], 'wb') as out:
        procs.append(subprocess.Popen(
            net.command(i, program('partitioned_allgathers', 'threads', end)),
            env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True))
    for log in logs:
      wait_text(log, 'LOOP', 120)
    companion = int(logs[0].read_text().split('COMPANION ', 1)[1].split()[0])
    assert companion > 0 and alive(companion), logs[0].read_text()[-2000:]
    if fault == 'cut':
      net.cut(2)
    else:
      procs[2].send_signal(signal.SIGSTOP)
    procs[0].wait(60)
    exited = time.monotonic()
    job = [companion, procs[1].pid] + ([procs[2].pid] if fault == 'cut'
                                        else [])
    left = _gone_within(job, _GONE_WITHIN_S)
    took = time.monotonic() - exited
    outs = [log.read_text(errors='replace') for log in logs]
    assert not left, (f'still running {_GONE_WITHIN_S:g} s after process 0 '
                      f'exited: {left} (companion {companion})', outs[0][-3000:])
    for p in procs:
      with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(1 if p is procs[2] and fault == 'freeze' else 10)
  print(f'{fault}, {end}: the job gone {took:.1f} s after process 0 exited; '
        f'exit statuses {[p.returncode for p in procs]}')
  for i in (0, 1):
    assert 'ERROR at ' in outs[i] and 'ProcessFailureError' in outs[i], (
        outs[i][-3000:])
    assert 'process(es) [2] failed' in outs[i], outs[i][-3000:]
