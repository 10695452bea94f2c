"""Under a real Slurm (Debian's slurm-wlm 22.05; tests/slurm_cluster.py): srun, sbatch, scontrol requeue, docs/restart.sbatch.

One node (2 tasks): README's example under `srun -n 2`, quiet; the recipe's
clean run of bin/train.py, quiet (no gloo connection lines); the recipe
with bin/train.py (2 tasks x 2 CPU devices) whose task 1's python is
SIGKILLed from outside while task 0 waits in a step's collective: the step
ends at once (not at the heartbeat), the job trains again within a bound,
ends COMPLETED, bitwise equal to an uninterrupted run; `scontrol requeue`
of a running job: it saves at the preemption notice, runs again and resumes
from that step, ends equal; a task exiting 78 stops the recipe after that
attempt.

Two nodes (two simulated hosts, one slurmd each): `sbatch --nodes=2
--ntasks-per-node=1` runs README's example and the same heal, the
coordinator found from Slurm's variables on the first node, across the
bridge.

Without root or Slurm's packages (.ci/slurm installs them) every test here
skips with the reason. Nothing of a job is left running after its test.
"""

from __future__ import annotations

import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import time

from _helpers import QUIET_RUN_LINES
from _helpers import clean_env
from _helpers import gloo_lines
from _helpers import quick_compile_env
import pytest
import slurm_cluster

from multihost import env as env_lib
from multihost import launch

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPE = ROOT / 'docs' / 'restart.sbatch'
TRAIN = ROOT / 'bin' / 'train.py'
FAILS = ROOT / 'tests' / 'launch_programs' / 'fails_as_told.py'
K = 5  # --save_every
STEPS = 30
STALL_AT = 17  # Task 1 stalls in its data loader here; the test kills it.
JOB_TIMEOUT_S = 180
# The heal's bounds, from the kill of task 1's python: the step ended (the
# recipe's next line), and every task trained again. Measured here (2 cores,
# load 5-6): 0.10-0.22 s and 2.5-5.2 s; at load 10-13: 0.05-0.3 s and
# 7.4-9.5 s; with Slurm's own end of the step
# (SIGTERM; the survivor leaves at the heartbeat, 10 s, + 7 s) 13.5-14 s and
# 23-27 s. The rest is the restart itself, mostly starting Python and JAX
# again, which a busy CPU stretches (at load 24: 15 s from the kill to the
# new process 0's first log line, 18.7-22 s to training again), so the
# step's end is the sharp bound and training again a loose one.
STEP_END_BOUND_S = 3.0
TRAINING_AGAIN_BOUND_S = 45.0
_DONE = ('COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT', 'NODE_FAIL',
         'OUT_OF_MEMORY', 'PREEMPTED', 'BOOT_FAIL', 'DEADLINE')


def _cluster(nodes: int) -> slurm_cluster.Cluster:
  ok, why = slurm_cluster.available()
  if not ok:
    pytest.skip(why)
  try:
    return slurm_cluster.shared(nodes)
  except slurm_cluster.ClusterError as e:
    pytest.fail(f'the {nodes}-node Slurm did not start: {e}')


@pytest.fixture(scope='module')
def slurm():
  return _cluster(1)


@pytest.fixture(scope='module')
def slurm2():
  return _cluster(2)


class Jobs:
  """Submits jobs to `cluster` from a test; cancels them and checks that nothing of them runs at the end."""

  def __init__(self, cluster: slurm_cluster.Cluster, tmp_path: pathlib.Path):
    self.cluster = cluster
    self.tmp_path = tmp_path
    self.name = f'mh-test-{random.randrange(10**9)}'
    self.ids: list[str] = []
    # The coordinator's port, held from other programs' port-0 binds: the
    # one JAX derives from the job id (61440 + ...) is the same in every
    # Slurm whose job ids start at 1 (another pytest session's, an Open MPI
    # test's), and JAX's service shares a port it binds (SO_REUSEPORT).
    self._hold = launch.hold_free_port()

  def env(self, **extra: str) -> dict[str, str]:
    port = str(self._hold.getsockname()[1])
    return clean_env(**self.cluster.env(), JAX_PLATFORMS='cpu',
                     JAX_NUM_CPU_DEVICES='2', PYTHONUNBUFFERED='1',
                     JAX_COORDINATOR_PORT=port, **quick_compile_env(),
                     **extra)

  def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """A Slurm client command (sbatch, scontrol, srun, ...), checked."""
    kwargs.setdefault('env', self.env())
    done = subprocess.run(self.cluster.client(argv), capture_output=True,
                          text=True, timeout=kwargs.pop('timeout', 60),
                          check=False, **kwargs)
    assert done.returncode == 0, (argv, done.stdout, done.stderr)
    return done

  def sbatch(self, flags: list[str], command: list[str], *, out: str,
             **env: str) -> str:
    done = self.run(['sbatch', '--parsable', f'--job-name={self.name}',
                     f'--output={out}', *flags, *command], cwd=ROOT,
                    env=self.env(**env))
    job = done.stdout.strip().split(';')[0]
    self.ids.append(job)
    return job

  def state(self, job: str) -> dict[str, str]:
    done = self.run(['scontrol', '--oneliner', 'show', 'job', job])
    return dict(w.split('=', 1) for w in done.stdout.split() if '=' in w)

  def wait(self, job: str, *, until=_DONE,
           timeout: float = JOB_TIMEOUT_S) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
      state = self.state(job)
      if state['JobState'] in until:
        return state
      if time.monotonic() > deadline:
        pytest.fail(f'job {job} not {until} within {timeout} s: {state}')
      time.sleep(0.2)

  def close(self) -> None:
    if self.ids:
      subprocess.run(self.cluster.client(['scancel', '--signal=KILL',
                                          '--full', *self.ids]),
                     env=self.env(), capture_output=True, timeout=60,
                     check=False)
    # (While Slurm's own end of a step waits out KillWait, the scancel
    # waits too: what is left after 10 s is killed here.)
    deadline = time.monotonic() + 10
    while any(_job_processes(j) for j in self.ids):
      if time.monotonic() > deadline:
        for pid in (p for j in self.ids for p in _job_processes(j)):
          try:
            os.kill(pid, signal.SIGKILL)
          except OSError:
            pass
        assert time.monotonic() < deadline + 10, (
            f'processes of jobs {self.ids} outlived them')
      time.sleep(0.2)
    self._hold.close()


@pytest.fixture
def jobs(slurm, tmp_path):
  j = Jobs(slurm, tmp_path)
  yield j
  j.close()


@pytest.fixture
def jobs2(slurm2, tmp_path):
  j = Jobs(slurm2, tmp_path)
  yield j
  j.close()


def _job_processes(job: str, task: int | None = None) -> list[int]:
  """Pids whose environment holds SLURM_JOB_ID=`job` (and SLURM_PROCID=`task`)."""
  marks = {f'SLURM_JOB_ID={job}'.encode()}
  if task is not None:
    marks.add(f'SLURM_PROCID={task}'.encode())
  pids = []
  for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{pid}/environ', 'rb') as f:
        if marks <= set(f.read().split(b'\0')):
          pids.append(int(pid))
    except OSError:
      pass
  return pids


def _task_python(job: str, task: int) -> int:
  """The pid of task `task`'s bin/train.py (not its children)."""
  found = []
  for pid in _job_processes(job, task):
    try:
      with open(f'/proc/{pid}/cmdline', 'rb') as f:
        argv = f.read().split(b'\0')
    except OSError:
      continue
    if len(argv) > 1 and argv[1].endswith(b'bin/train.py'):
      found.append(pid)
  assert len(found) == 1, (job, task, found)
  return found[0]


def _read(path: pathlib.Path) -> str:
  try:
    return path.read_text(errors='replace')
  except FileNotFoundError:
    return ''


def _wait_for(path: pathlib.Path, pattern: str, *, count: int = 1,
              timeout: float = JOB_TIMEOUT_S) -> float:
  """Waits until `pattern` occurs `count` times in the file; returns when it was seen."""
  deadline = time.monotonic() + timeout
  while len(re.findall(pattern, _read(path))) < count:
    if time.monotonic() > deadline:
      pytest.fail(f'no {pattern!r} (x{count}) in {path} within {timeout} s:'
                  f'\n{_read(path)[-3000:]}')
    time.sleep(0.05)
  return time.time()


def _digest(out: str) -> str:
  (digest,) = re.findall(r'Finished step \d+ .*digest (\w+)', out)
  return digest


def _train(tmp_path: pathlib.Path, *flags: str) -> list[str]:
  return [str(RECIPE), 'python', str(TRAIN),
          f'--checkpoint_dir={tmp_path}/ckpt', f'--steps={STEPS}',
          f'--save_every={K}', *flags]


def _swap_example(tmp_path: pathlib.Path) -> pathlib.Path:
  readme = (ROOT / 'README.md').read_text()
  (block,) = [b for b in re.findall(r'^```python\n(.*?)^```', readme,
                                    re.S | re.M)
              if '# Before: from jax.experimental.multihost_utils' in b]
  path = tmp_path / 'swap_example.py'
  path.write_text(block)
  return path


@pytest.fixture(scope='module')
def uninterrupted_run(slurm, tmp_path_factory) -> str:
  """The output of the recipe's uninterrupted run (one node, 2 tasks)."""
  tmp_path = tmp_path_factory.mktemp('uninterrupted')
  j = Jobs(slurm, tmp_path)
  try:
    out = tmp_path / 'job.out'
    job = j.sbatch(['--ntasks=2'], _train(tmp_path), out=str(out))
    state = j.wait(job)
    text = _read(out)
    assert state['JobState'] == 'COMPLETED', (state, text[-3000:])
    assert 'restart.sbatch' not in text, text[-3000:]
    return text
  finally:
    j.close()


@pytest.fixture(scope='module')
def uninterrupted(uninterrupted_run) -> str:
  """The digest of the recipe's uninterrupted run."""
  return _digest(uninterrupted_run)


def test_a_clean_run_under_the_recipe_is_quiet(uninterrupted_run):
  # No gloo connection line (4 of them: 2 tasks x 2 devices), no per-step
  # line: what the launcher's quiet run prints.
  # The recipe reads srun's stdout through python -m multihost.launch.quiet,
  # which drops gloo's lines (the tasks' own stdout is left alone).
  lines = uninterrupted_run.splitlines()
  assert not gloo_lines(uninterrupted_run), lines
  assert len(lines) <= QUIET_RUN_LINES, lines


def test_the_readme_example_runs_under_srun_and_is_quiet(jobs, tmp_path):
  example = _swap_example(tmp_path)
  done = jobs.run(['srun', '--ntasks=2', '--kill-on-bad-exit=1',
                   f'--job-name={jobs.name}', sys.executable, str(example)],
                  cwd=tmp_path, timeout=JOB_TIMEOUT_S)
  lines = (done.stdout + done.stderr).splitlines()
  assert sorted(ln for ln in lines if ln.startswith('process ')) == [
      'process 0: seed 1234, ids [0, 1]', 'process 1: seed 1234, ids [0, 1]'
  ], lines
  assert len(lines) <= QUIET_RUN_LINES, lines


def _heal(jobs: Jobs, tmp_path: pathlib.Path, flags: list[str]):
  """The recipe's bin/train.py; task 1's python SIGKILLed from outside while task 0 waits in step STALL_AT's collective."""
  out = tmp_path / 'job.out'
  job = jobs.sbatch(flags, _train(
      tmp_path, f'--drill_stall_at_step={STALL_AT}', '--drill_stall_process=1'),
                    out=str(out))
  _wait_for(out, rf'process 1 stalls in its data loader of step {STALL_AT}')
  time.sleep(0.5)  # Task 0 is in step STALL_AT's collective by now.
  os.kill(_task_python(job, 1), signal.SIGKILL)
  killed = time.time()
  ended = _wait_for(out, r'restart\.sbatch: attempt 0 failed')
  state = jobs.wait(job)
  text = _read(out)
  again = [float(t) for t in re.findall(
      r'\[process=\d\] Training again: step \d+ done at (\d+\.\d+)', text)]
  assert state['JobState'] == 'COMPLETED', (state, text[-4000:])
  assert state['ExitCode'] == '0:0', state
  assert ('restart.sbatch: attempt 0 failed (status 137); restarting all '
          '(restart 1 of 3).') in text, text[-4000:]
  assert 'attempt 1 failed' not in text, text[-4000:]
  # Every process resumed from the same step: the newest committed save.
  resumed = re.findall(r'\[process=(\d)\] Resumed from step (\d+)', text)
  assert sorted(p for p, _ in resumed) == ['0', '1'], text[-4000:]
  (step,) = {int(s) for _, s in resumed}
  assert step % K == 0 and 0 < STALL_AT - step <= 2 * K, text[-4000:]
  assert len(again) == 2, text[-4000:]
  print(f'heal ({flags}): kill -> step ended {ended - killed:.2f} s, '
        f'-> training again {max(again) - killed:.2f} s')
  assert ended - killed < STEP_END_BOUND_S, text[-4000:]
  assert max(again) - killed < TRAINING_AGAIN_BOUND_S, text[-4000:]
  return text


def test_a_task_killed_from_outside_heals_at_once_bitwise_equal(
    jobs, tmp_path, uninterrupted):
  text = _heal(jobs, tmp_path, ['--ntasks=2'])
  assert 'srun: error: 127.0.0.1: task 1: Killed' in text, text[-4000:]
  assert _digest(text) == uninterrupted


def test_a_requeued_job_resumes_from_its_newest_checkpoint_equal(
    jobs, tmp_path, uninterrupted):
  out = tmp_path / 'job.out'
  # Task 0 stalls 3 s at step 12 of the first run: the requeue lands while
  # the job trains.
  job = jobs.sbatch(['--ntasks=2'], _train(
      tmp_path, '--drill_stall_at_step=12', '--drill_stall_process=0',
      '--drill_stall_seconds=3'), out=str(out))
  _wait_for(out, r'process 0 stalls in its data loader of step 12')
  jobs.run(['scontrol', 'requeue', job])
  jobs.wait(job, until=('PENDING',), timeout=60)
  # Slurm holds a requeued job back for a while (Reason=BeginTime).
  jobs.run(['scontrol', 'update', f'jobid={job}', 'StartTime=now'])
  state = jobs.wait(job)
  text = _read(out)
  assert state['JobState'] == 'COMPLETED', (state, text[-4000:])
  assert state['Restarts'] == '1', state
  (saved,) = re.findall(r'Preempted: saved step (\d+)', text)
  assert int(saved) >= 12, text[-4000:]
  resumed = re.findall(r'\[process=(\d)\] Resumed from step (\d+)', text)
  assert sorted(resumed) == [('0', saved), ('1', saved)], text[-4000:]
  assert _digest(text) == uninterrupted


def test_a_task_exiting_78_stops_the_recipe_after_that_attempt(
    jobs, tmp_path):
  status = env_lib.NO_RETRY_EXIT_STATUS
  out = tmp_path / 'job.out'
  job = jobs.sbatch(['--ntasks=2'], [str(RECIPE), 'python', str(FAILS)],
                    out=str(out), FAIL_STATUS=str(status),
                    SURVIVOR_SLEEP='60')
  state = jobs.wait(job, timeout=60)
  text = _read(out)
  assert state['JobState'] == 'FAILED', (state, text)
  assert state['ExitCode'] == f'{status}:0', state
  assert f'task 1: Exited with exit code {status}\n' in text, text
  assert (f'restart.sbatch: attempt 0 failed (status 137): a task exited '
          f'with status {status}, which says restarting will not help') in (
              text), text
  assert 'attempt 1' not in text, text


def test_two_nodes_run_the_readme_example_across_hosts(jobs2, tmp_path):
  example = _swap_example(tmp_path)
  out = tmp_path / 'job.out'
  job = jobs2.sbatch(
      ['--nodes=2', '--ntasks-per-node=1', '--wrap',
       f'srun bash -c \'echo "task $SLURM_PROCID on $(hostname)"; exec '
       f'{sys.executable} {example}\''], [], out=str(out))
  state = jobs2.wait(job)
  text = _read(out)
  assert state['JobState'] == 'COMPLETED', (state, text)
  hosts = dict(re.findall(r'task (\d) on (\S+)', text))
  assert hosts == {'0': jobs2.cluster.node_names[0],
                   '1': jobs2.cluster.node_names[1]}, text
  assert sorted(ln for ln in text.splitlines()
                if ln.startswith('process ')) == [
                    'process 0: seed 1234, ids [0, 1]',
                    'process 1: seed 1234, ids [0, 1]'], text


def test_two_nodes_heal_a_task_killed_from_outside_bitwise_equal(
    jobs2, tmp_path, uninterrupted):
  text = _heal(jobs2, tmp_path, ['--nodes=2', '--ntasks-per-node=1'])
  first, second = jobs2.cluster.node_names
  # Process 0's service on the first node; task 1 on the other host.
  assert f'Starting JAX distributed service on {first}:' in text, text[-4000:]
  assert f'srun: error: {second}: task 1: Killed' in text, text[-4000:]
  assert _digest(text) == uninterrupted
