"""Two runs entering one checkpoint folder over a stale lock at the same instant.

The attack: a run died and left its lock; two new runs start on
that folder together. The lock's takeover must be atomic: in every trial
exactly one of them holds the folder and the other is refused, naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import select
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = str(ROOT / 'tests' / 'folder_holder.py')
TRIALS = 100
REPLY_TIMEOUT_S = 60


def _dead_pid() -> int:
  proc = subprocess.Popen([sys.executable, '-c', 'pass'])
  proc.wait(timeout=60)
  return proc.pid


def _stale_lock(folder: pathlib.Path, pid: int) -> None:
  """The lock file a run on this host left when it died (pid `pid`)."""
  (folder / '.recovery-lock').write_text(json.dumps(
      {'host': socket.gethostname(), 'pid': pid, 'proc_start': '1',
       'time': time.time() - 60, 'nonce': 'deadbeefdeadbeef'}))


def _reply(proc: subprocess.Popen) -> str:
  ready, _, _ = select.select([proc.stdout], [], [], REPLY_TIMEOUT_S)
  assert ready, f'contender pid {proc.pid} gave no answer in {REPLY_TIMEOUT_S} s'
  line = proc.stdout.readline()
  assert line, f'contender pid {proc.pid} exited (rc {proc.poll()})'
  return line.strip()


@contextlib.contextmanager
def _contenders(folder: pathlib.Path, n: int):
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1'}
  procs = []
  try:
    for _ in range(n):
      procs.append(subprocess.Popen(
          [sys.executable, WORKER, str(folder)], stdin=subprocess.PIPE,
          stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT))
    yield procs
  finally:
    for p in procs:
      if p.poll() is None:
        with contextlib.suppress(OSError):
          p.stdin.write('quit\n')
          p.stdin.flush()
    deadline = time.monotonic() + 20
    for p in procs:
      try:
        p.wait(timeout=max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=10)


def _send(proc: subprocess.Popen, line: str) -> None:
  proc.stdin.write(line + '\n')
  proc.stdin.flush()


def test_a_stale_lock_is_taken_over_by_exactly_one_of_two_runs(tmp_path):
  folder = tmp_path / 'ckpt'
  folder.mkdir()
  dead = _dead_pid()
  both, neither = [], []
  with _contenders(folder, 2) as procs:
    for trial in range(TRIALS):
      _stale_lock(folder, dead)
      start = time.time() + 0.05
      for p in procs:
        _send(p, f'go {start}')
      replies = [_reply(p) for p in procs]
      winners = [i for i, r in enumerate(replies) if r == 'won']
      if len(winners) > 1:
        both.append(trial)
      elif not winners:
        neither.append((trial, replies))
      else:
        loser = replies[1 - winners[0]]
        assert loser.startswith('refused') and 'in use by another run' in (
            loser), loser
      for p in procs:
        _send(p, 'release')
      assert [_reply(p) for p in procs] == ['released', 'released']
  assert not both, (f'both runs held the folder in {len(both)} of {TRIALS} '
                    f'trials: {both}')
  assert not neither, f'no run took the stale lock: {neither[:3]}'
