"""docs/restart.sbatch, the Slurm restart recipe, run as sbatch would with a stand-in `srun`, `squeue` and `scancel` (tests/slurm_standin/); tests/multiprocess/test_slurm_real.py runs it under a real Slurm.

bin/train.py at 2 tasks x 2 devices under the recipe: a SIGKILL of task 1
mid-run ends the step (the recipe's `scancel --signal=KILL`), the recipe starts it again
with MULTIHOST_RESTART_COUNT=1, the run resumes from the newest checkpoint
and ends with 0, and its final state is bitwise equal to an uninterrupted
run's. With a small program (tests/launch_programs/fails_as_told.py): a
task's exit status 78 stops the recipe after that attempt, and every
attempt gets the same compilation cache folder. Nothing of the job (tagged
by its SLURM_JOB_ID) is left running.
"""

from __future__ import annotations

import os
import pathlib
import random
import re
import signal
import subprocess
import sys

from _helpers import clean_env
from _helpers import held_port
from _helpers import quick_compile_env
import pytest

from multihost import env as env_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPE = ROOT / 'docs' / 'restart.sbatch'
STANDIN = ROOT / 'tests' / 'slurm_standin'
TRAIN = ROOT / 'bin' / 'train.py'
FAILS = ROOT / 'tests' / 'launch_programs' / 'fails_as_told.py'
K = 5  # --save_every
STEPS = 30
KILL_AFTER = 17
BOUND_S = 300


def _job_processes(job: str) -> list[int]:
  """Pids whose environment holds SLURM_JOB_ID=`job` (only this test's)."""
  mark = f'SLURM_JOB_ID={job}'.encode()
  pids = []
  for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{pid}/environ', 'rb') as f:
        if mark in f.read().split(b'\0'):
          pids.append(int(pid))
    except OSError:
      pass
  return pids


def _sbatch(tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, str]:
  return _recipe(['python', str(TRAIN), f'--checkpoint_dir={tmp_path}/ckpt',
                  f'--steps={STEPS}', f'--save_every={K}', *flags],
                 **quick_compile_env())


def _recipe(program: list[str], *, cwd: os.PathLike[str] | str = ROOT,
            path: str | None = None,
            **extra: str) -> tuple[subprocess.CompletedProcess, str]:
  """The recipe, as sbatch runs it, with `program` (2 tasks), from `cwd`; `path`: its $PATH (default: the stand-in srun, this Python's folder, ours); `extra`: more environment."""
  job = str(random.randrange(10**5, 10**6))
  # The port stays held from other runs' port-0 binds across the restarts.
  with held_port() as port:
    return _run_recipe(program, job, cwd=cwd, path=path, port=port, **extra)


def _run_recipe(program, job, *, cwd, path, port, **extra):
  env = clean_env(
      PATH=path or (f'{STANDIN}:{os.path.dirname(sys.executable)}:'
                    f'{os.environ["PATH"]}'),
      SLURM_JOB_ID=job, SLURM_NTASKS='2', JAX_NUM_CPU_DEVICES='2',
      JAX_PLATFORMS='cpu', JAX_COORDINATOR_PORT=str(port),
      MULTIHOST_HEARTBEAT_TIMEOUT='5', MAX_RESTARTS='2', PYTHONUNBUFFERED='1',
      **extra)
  command = ['bash', str(RECIPE), *program]
  proc = subprocess.Popen(command, env=env, cwd=cwd, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True)
  try:
    out, err = proc.communicate(timeout=BOUND_S)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGTERM)  # The stand-in srun ends its step.
    out, err = proc.communicate(timeout=30)
    pytest.fail(f'the recipe ran past {BOUND_S} s:\n{out[-3000:]}'
                f'{err[-3000:]}')
  assert not _job_processes(job), 'processes of the job outlived it'
  return subprocess.CompletedProcess(command, proc.returncode, out, err), job


def _digest(out: str) -> str:
  (digest,) = re.findall(r'Finished step \d+ .*digest (\w+)', out)
  return digest


def test_a_sigkilled_task_is_restarted_by_the_recipe_bitwise_equal(tmp_path):
  reference, _ = _sbatch(tmp_path / 'reference')
  assert reference.returncode == 0, reference.stderr[-3000:]
  assert 'restart.sbatch' not in reference.stderr
  run, _ = _sbatch(tmp_path / 'killed', f'--drill_kill_after_step={KILL_AFTER}')
  log = run.stdout + run.stderr
  assert run.returncode == 0, log[-5000:]
  assert f'Drill: process 1 SIGKILLs itself after step {KILL_AFTER}' in log
  assert ('restart.sbatch: attempt 0 failed (status 137); restarting all '
          '(restart 1 of 2).') in run.stderr, run.stderr[-3000:]
  # Every process resumed from the same step: the newest committed save
  # (step 15's asynchronous commit may not have finished at the kill).
  resumed = re.findall(r'\[process=(\d)\] Resumed from step (\d+)', log)
  assert sorted(p for p, _ in resumed) == ['0', '1'], log[-3000:]
  (step,) = {int(s) for _, s in resumed}
  assert step % K == 0 and 0 < KILL_AFTER - step <= 2 * K, log[-3000:]
  assert 'attempt 1 failed' not in run.stderr
  assert _digest(log) == _digest(reference.stdout + reference.stderr)


def test_a_task_that_exits_78_stops_the_recipe_after_that_attempt(tmp_path):
  status = env_lib.NO_RETRY_EXIT_STATUS
  # Task 1 exits 78; srun's step end kills task 0 (SIGKILL), so srun exits
  # with 137, as Slurm's srun would: the recipe reads srun's line for task 1.
  run, _ = _recipe(['python', str(FAILS)], FAIL_STATUS=str(status),
                   SURVIVOR_SLEEP='60', SLURM_SUBMIT_DIR=str(tmp_path),
                   PROJECT_DIR=str(ROOT))
  log = run.stdout + run.stderr
  assert run.returncode == status, log[-3000:]
  assert 'attempt 0 cache' in run.stdout and 'attempt 1' not in log
  assert f'task 1: Exited with exit code {status}\n' in run.stderr
  assert (f'restart.sbatch: attempt 0 failed (status 137): a task exited '
          f'with status {status}, which says restarting will not help') in (
              run.stderr), run.stderr[-3000:]
  assert f'no_retry={status}  # multihost.env.NO_RETRY_EXIT_STATUS' in (
      RECIPE.read_text())


def test_every_attempt_of_the_recipe_gets_the_same_compilation_cache(
    tmp_path):
  # (Submitted from tmp_path; the project, and its venv, is ROOT.)
  # (The survivor sleeps 30 s: the recipe's end of the step kills it.)
  run, job = _recipe(['python', str(FAILS)], FAIL_UNTIL_ATTEMPT='0',
                     SURVIVOR_SLEEP='30', SLURM_SUBMIT_DIR=str(tmp_path),
                     PROJECT_DIR=str(ROOT))
  assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
  # (Status 137: the step's end killed task 0, and srun reports the signal.)
  assert ('restart.sbatch: attempt 0 failed (status 137); restarting all '
          '(restart 1 of 2).') in run.stderr
  folder = tmp_path / f'.jax-cache-{job}'
  for k in (0, 1):
    for i in (0, 1):
      assert (f'process {i} attempt {k} cache {str(folder)!r} exists '
              'False\n') in run.stdout, run.stdout
  assert not folder.exists()
  # A folder the user chose is passed on as it is.
  mine = str(tmp_path / 'mine')
  run, _ = _recipe(['python', str(FAILS)], FAIL_UNTIL_ATTEMPT='0',
                   JAX_COMPILATION_CACHE_DIR=mine)
  assert run.returncode == 0 and run.stdout.count(f'cache {mine!r}') == 4


def test_the_recipe_changes_to_the_project_and_activates_its_venv(tmp_path):
  # As sbatch runs it: from Slurm's spool folder (here an empty one), with
  # no Python of the project's on $PATH; the command's paths are relative to
  # the project. Attempt 0 fails, attempt 1 succeeds.
  spool = tmp_path / 'spool'
  spool.mkdir()
  plain = f'{STANDIN}:/usr/bin:/bin'
  program = ['bash', '-c', 'echo "task $SLURM_PROCID cwd=$PWD python='
             '$(command -v python) venv=$VIRTUAL_ENV"; exec python '
             'tests/launch_programs/fails_as_told.py']
  run, _ = _recipe(program, cwd=spool, path=plain, SLURM_SUBMIT_DIR=str(ROOT),
                   FAIL_UNTIL_ATTEMPT='0', SURVIVOR_SLEEP='30')
  log = run.stdout + run.stderr
  assert run.returncode == 0, log[-3000:]
  venv = os.path.realpath(ROOT / '.venv')
  for task in (0, 1):
    line = re.search(rf'task {task} cwd=(\S+) python=(\S+) venv=(\S+)',
                     run.stdout)
    assert line, run.stdout
    cwd, python, active = line.groups()
    assert cwd == str(ROOT), line.group(0)
    assert os.path.realpath(active) == venv, line.group(0)
    assert python == f'{active}/bin/python', line.group(0)
    assert f'process {task} attempt 1 cache' in run.stdout
  # (Status 137: the step's end killed task 0, as Slurm's does.)
  assert ('restart.sbatch: attempt 0 failed (status 137); restarting all '
          '(restart 1 of 2).') in run.stderr, run.stderr
  # No virtualenv where it says: it stops at once, saying what to set.
  run, _ = _recipe(program, cwd=spool, path=plain, SLURM_SUBMIT_DIR=str(ROOT),
                   VENV=str(tmp_path / 'none'))
  assert run.returncode == env_lib.NO_RETRY_EXIT_STATUS, run.stderr
  assert (f'restart.sbatch: no virtualenv at {tmp_path}/none (no '
          'bin/activate); set VENV') in run.stderr
  assert 'task 0' not in run.stdout


def test_the_recipe_asks_slurm_to_requeue_it_on_node_loss():
  directives = [line for line in RECIPE.read_text().splitlines()
                if line.startswith('#SBATCH')]
  assert '#SBATCH --requeue' in directives, directives
