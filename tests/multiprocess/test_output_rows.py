"""A controller's output reaches its reader whole and in order, with the errors a program expects; `multihost.initialize()` leaves fd 1 alone.

Real controllers (tests/programs/output_rows.py: `multihost.initialize()`,
then a device collective, so gloo prints its connection line), each row run
with the quiet setting on (the default) and off (`MULTIHOST_QUIET_GLOO=0`):

- 20 000 lines then `os._exit(75)` under `python -m multihost.launch
  --num_processes=2`: all 40 000 arrive;
- the same with each controller PID 1 of its own PID namespace (a
  container's entrypoint): 6 lines each, all arrive;
- 200 flushed stdout lines then one stderr line under the launcher: the
  stderr line is last, and whole;
- stdout a pipe that `head -1` closes: the program gets BrokenPipeError;
- stdout a file on a full disk: the program gets OSError (ENOSPC), and
  lines written once there is space arrive.

Everything is bounded in time and leaves nothing running.
"""

from __future__ import annotations

import errno
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time

import _helpers
import pytest

from multihost import env as env_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY = sys.executable
TIMEOUT_S = 180
QUIET = pytest.mark.parametrize('quiet', ['default', '0'])
_FD1 = re.compile(r'^(?:\[p\d\] )?fd1 before=(\S+) after=(\S+)$', re.M)


def _env(quiet: str, **extra: str) -> dict[str, str]:
  env = _helpers.clean_env(**_helpers.quick_compile_env(), **extra)
  env[env_lib.PLATFORMS] = 'cpu'
  if quiet != 'default':
    env[env_lib.QUIET_GLOO] = quiet
  return env


def _launch(quiet: str, *command: str) -> tuple[int, str]:
  """`python -m multihost.launch --num_processes=2 -- COMMAND`: (status, stdout and stderr)."""
  done = subprocess.run(
      [PY, '-m', 'multihost.launch', '--num_processes=2', '--', *command],
      cwd=ROOT, env=_env(quiet), stdin=subprocess.DEVNULL,
      capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
  return done.returncode, done.stdout + done.stderr


def _fd1_unchanged(out: str, count: int = 2) -> None:
  """Each controller said fd 1 was the same before and after initialize()."""
  seen = _FD1.findall(out)
  assert len(seen) == count, out[-3000:]
  assert all(before == after for before, after in seen), seen


def _gloo_as_asked(quiet: str, out: str) -> None:
  """No gloo line when quiet; gloo's lines there when not."""
  found = _helpers.gloo_lines(out)
  assert bool(found) == (quiet == '0'), (quiet, found, out[-2000:])


@QUIET
def test_every_line_of_a_burst_before_os_exit_arrives(quiet):
  rc, out = _launch(quiet, *_helpers.program('output_rows', 'burst', 20000,
                                             75))
  assert rc == 75, out[-3000:]
  for i in range(2):
    got = re.findall(rf'^\[p{i}\] line (\d+)$', out, re.M)
    assert got == [str(k) for k in range(20000)], (
        f'process {i}: {len(got)} of 20000 lines, in order: '
        f'{got == sorted(got, key=int)}; {out[-2000:]}')
  _fd1_unchanged(out)
  _gloo_as_asked(quiet, out)


@QUIET
def test_pid_1_of_a_pid_namespace_loses_nothing(quiet):
  if os.geteuid() != 0 or not shutil.which('unshare'):
    pytest.skip('needs root and unshare (a PID namespace per controller)')
  rc, out = _launch(quiet, 'unshare', '--pid', '--fork', '--mount-proc',
                    *_helpers.program('output_rows', 'burst', 6, 75))
  assert rc == 75, out[-3000:]
  for i in range(2):
    assert re.findall(rf'^\[p{i}\] line (\d+)$', out, re.M) == [
        str(k) for k in range(6)], out[-3000:]
  _fd1_unchanged(out)


@QUIET
def test_stdout_then_stderr_keep_their_order_under_the_launcher(quiet):
  rc, out = _launch(quiet, *_helpers.program('output_rows', 'order'))
  assert rc == 0, out[-3000:]
  for i in range(2):
    mine = [ln for ln in out.splitlines() if ln.startswith(f'[p{i}] ')
            and not ln.startswith(f'[p{i}] fd1 ') and not (
                quiet == '0' and _helpers.gloo_lines(ln))]
    assert mine == [f'[p{i}] line {k}' for k in range(200)] + [
        f'[p{i}] ERR after 200 lines'], mine[-5:]
  _fd1_unchanged(out)
  _gloo_as_asked(quiet, out)


def _by_hand(tmp_path: pathlib.Path, quiet: str, shell: str,
             *args: str) -> list[subprocess.CompletedProcess]:
  """Two controllers (JAX_COORDINATOR_ADDRESS, ...), each `bash -c SHELL` with $0 the program's command line; both at once."""
  with _helpers.held_port() as port:
    envs = [_env(quiet, **{env_lib.COORDINATOR: f'127.0.0.1:{port}',
                           env_lib.NUM_PROCESSES: '2',
                           env_lib.PROCESS_ID: str(i), 'INDEX': str(i)})
            for i in range(2)]
  command = ' '.join(f"'{a}'" for a in _helpers.program('output_rows', *args))
  procs = [subprocess.Popen(['bash', '-c', shell.replace('PROGRAM', command)],
                            cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for env in envs]
  try:
    outs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
  finally:
    _helpers.wait_all(procs, timeout=10)
  return [subprocess.CompletedProcess(p.args, p.returncode, o, e)
          for p, (o, e) in zip(procs, outs, strict=True)]


@QUIET
def test_a_closed_pipe_gives_the_program_broken_pipe(tmp_path, quiet):
  # `python prog.py | head -1`, for each of two controllers.
  done = _by_hand(tmp_path, quiet, 'PROGRAM epipe | head -1')
  for d in done:
    # head's one line: the program's first, or gloo's (nothing filters here).
    assert d.returncode == 0 and len(d.stdout.splitlines()) == 1, d
    assert re.search(rf'stdout failed after \d+ lines: BrokenPipeError '
                     rf'errno {errno.EPIPE}', d.stderr), d.stderr[-3000:]
    _fd1_unchanged(d.stderr, count=1)


@pytest.fixture
def tiny_disk(tmp_path):
  """A 1 MiB tmpfs (needs root), unmounted after the test."""
  if os.geteuid() != 0:
    pytest.skip('needs root (mounts a tmpfs)')
  disk = tmp_path / 'disk'
  disk.mkdir()
  subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', str(disk)],
                 check=True, timeout=30)
  try:
    yield disk
  finally:
    subprocess.run(['umount', '-l', str(disk)], check=False, timeout=30)


@QUIET
def test_a_full_disk_gives_oserror_and_later_lines_arrive(tmp_path, tiny_disk,
                                                          quiet):
  filler = tiny_disk / 'filler'
  with open(filler, 'wb', buffering=0) as f:  # All, then a few pages free.
    try:
      while True:
        f.write(b'\0' * 4096)
    except OSError as e:
      assert e.errno == errno.ENOSPC, e
  os.truncate(filler, filler.stat().st_size - 16384)
  marks = tmp_path / 'marks'
  marks.mkdir()
  # Each controller's stdout is a file on the tiny disk; the disk gets
  # space again once both said it was full.
  shell = f'exec PROGRAM > {tiny_disk}/out.$INDEX'
  freer = threading.Thread(target=_free_when_full,
                           args=(marks, filler), daemon=True)
  freer.start()
  done = _by_hand(tmp_path, quiet, shell, 'full', str(marks))
  freer.join(10)
  for i, d in enumerate(done):
    assert d.returncode == 0, d
    assert re.search(rf'stdout failed after \d+ lines: OSError errno '
                     rf'{errno.ENOSPC}', d.stderr), d.stderr[-3000:]
    text = (tiny_disk / f'out.{i}').read_text()
    assert 'line 0\nline 1\n' in text[:200], text[:200]
    assert text.endswith(''.join(f'after {k}\n' for k in range(5))), (
        text[-200:])
    _fd1_unchanged(d.stderr, count=1)


def _free_when_full(marks: pathlib.Path, filler: pathlib.Path) -> None:
  deadline = time.monotonic() + TIMEOUT_S
  while not all((marks / f'full.{i}').exists() for i in range(2)):
    if time.monotonic() > deadline:
      return
    time.sleep(0.05)
  filler.unlink()
  (marks / 'freed').touch()
