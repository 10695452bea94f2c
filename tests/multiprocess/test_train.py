"""Drills on the main job, bin/train.py, with real processes and real signals.

Multi-controller runs go through `multihost.launch` (jax.distributed over gloo
on localhost); single-controller runs are plain subprocesses without any
cluster environment. Every process is bounded in time and killed by pid if it
outlives its test.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import _helpers
import jax
import numpy as np
import pytest

from multihost import env as env_lib
from multihost import launch
import recovery

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / 'bin' / 'train.py')
VERIFY = str(ROOT / 'bin' / 'verify_checkpoint.py')
PY = sys.executable
# Long enough to preempt mid-run (the agreed stop after SIGTERM at step 50
# falls up to a second's worth of steps later: room for several times that);
# an epoch's end (8 steps an epoch); short enough for CI.
STEPS = 400
RUN_TIMEOUT_S = 120
# bin/train.py's status when restarting will not help.
NO_RETRY = env_lib.NO_RETRY_EXIT_STATUS
# Cluster variables a single-controller run must not inherit.
_CLUSTER_VARS = (env_lib.COORDINATOR, env_lib.NUM_PROCESSES,
                 env_lib.PROCESS_ID, env_lib.OMPI_HNP_URI, env_lib.OMPI_SIZE,
                 env_lib.SLURM_JOB_ID)


# -- helpers ------------------------------------------------------------------


def _single_env(devices: int = 4) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items()
         if k not in _CLUSTER_VARS + recovery.RESTART_COUNT_VARIABLES}
  env.update({env_lib.NUM_CPU_DEVICES: str(devices), env_lib.PLATFORMS: 'cpu',
              env_lib.PYTHON_UNBUFFERED: '1', **_helpers.quick_compile_env()})
  return env


@contextlib.contextmanager
def _single(args, *, log: pathlib.Path, devices: int = 4,
            env: dict[str, str] | None = None):
  """A single controller (no jax.distributed); killed by pid on exit."""
  with open(log, 'wb') as out:
    proc = subprocess.Popen([PY, *args], env={**_single_env(devices),
                                              **(env or {})}, cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
  try:
    yield proc
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait(timeout=30)


def _run_single(args, *, log: pathlib.Path, devices: int = 4,
                timeout: float = RUN_TIMEOUT_S,
                env: dict[str, str] | None = None) -> tuple[int, str]:
  with _single(args, log=log, devices=devices, env=env) as proc:
    rc = proc.wait(timeout=timeout)
  return rc, log.read_text()


def _run_cluster(args, *, num_processes, devices_per_process):
  result = launch.launch([PY, *args], num_processes=num_processes,
                         devices_per_process=devices_per_process,
                         timeout=RUN_TIMEOUT_S, cwd=ROOT,
                         env=_helpers.quick_compile_env())
  assert result.ok, result.summary + '\n' + result.outputs[0][-3000:]
  return result


def _wait_for_lines(path: pathlib.Path, n: int, *, alive, timeout: float):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if path.exists() and path.read_text().count('\n') >= n:
      return
    assert alive(), f'the run ended before writing {n} metrics lines'
    time.sleep(0.02)
  raise AssertionError(f'{path} did not reach {n} lines in {timeout} s')


def _metrics(path: pathlib.Path) -> dict[int, dict]:
  """Step -> record; a step written twice (by a killed run and its resume)
  must have been written identically."""
  out = {}
  for line in path.read_text().splitlines():
    rec = json.loads(line)
    if 'event' in rec:  # A save or resume mark (for bin/plot.py).
      continue
    if rec['step'] in out:
      assert out[rec['step']] == rec, f'step {rec["step"]} differs on replay'
    out[rec['step']] = rec
  return out


def _final_digest(output: str) -> str:
  for line in output.splitlines():
    if line.startswith('Finished step'):
      return line.split(' digest ')[1].split()[0]
  raise AssertionError('no "Finished step" line in:\n' + output[-3000:])


def _stored_state(directory, step=None) -> recovery.TransitionState:
  """Reads a checkpoint in this process, as NumPy arrays."""
  with recovery.Checkpoints(directory, read_only=True) as ckpt:
    step = ckpt.latest_step() if step is None else step
    tree = ckpt.stored_tree(step)
    target = recovery.TransitionState(
        user=tree['user'],
        key=jax.random.wrap_key_data(tree['data']['key']),
        order=tree['data']['order'], cursor=0, epoch=0, step=0)
    return ckpt.restore(target, step=step)


def _train_args(directory, metrics, *extra):
  return [TRAIN, f'--checkpoint_dir={directory}', f'--metrics_out={metrics}',
          f'--steps={STEPS}', '--save_every=100', '--keep=2', *extra]


# -- the uninterrupted 2x2 reference run --------------------------------------


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """An uninterrupted run at P=2 x 2 devices, with a 3-step replay check."""
  tmp = tmp_path_factory.mktemp('reference')
  result = _run_cluster(
      _train_args(tmp / 'ckpt', tmp / 'metrics.jsonl', '--verify_replay=3'),
      num_processes=2, devices_per_process=2)
  return dict(dir=tmp / 'ckpt', metrics=_metrics(tmp / 'metrics.jsonl'),
              output=result.outputs[0],
              digest=_final_digest(result.outputs[0]))


def test_replay_check_across_an_epoch_boundary(reference):
  # 64 samples in batches of 8: step STEPS ends epoch STEPS / 8 - 1, so the
  # 3 replayed steps start a new epoch, reshuffled from the carried key.
  out = reference['output']
  assert STEPS % 8 == 0
  assert (f'Replay check passed: 3 steps from checkpoint step {STEPS}: '
          'sample ids identical') in out
  replay_ids = json.loads(out.split('Replay ids: ')[1].splitlines()[0])
  sampler = recovery.EpochSampler(64, 8)
  key, order = sampler.start(jax.random.key(17))
  state = recovery.TransitionState(user=None, key=key, order=order, cursor=0,
                                   epoch=0, step=0)
  ids = []
  for _ in range(STEPS + 3):
    batch, state = sampler.next(state)
    ids.append(batch.tolist())
  assert state.epoch == STEPS // 8
  assert replay_ids == ids[STEPS:]
  # The reference's own metrics carry the same sampler's ids.
  assert reference['metrics'][STEPS]['ids'] == ids[STEPS - 1]


def test_preempted_and_resumed_run_is_bitwise_identical_then_elastic(
    reference, tmp_path):
  """SIGTERM to process 1 of 2: all agree on a step, save, exit 0; a resume
  reaches the reference's exact final state; the same checkpoint resumed on
  1x4 and 4x1 reaches it within the tutorial's tolerances."""
  ckpt, metrics = tmp_path / 'ckpt', tmp_path / 'metrics.jsonl'
  with launch.Controllers([PY, *_train_args(ckpt, metrics)], num_processes=2,
                          devices_per_process=2, cwd=ROOT,
                          env=_helpers.quick_compile_env()) as cluster:
    _wait_for_lines(metrics, 50, alive=lambda: len(cluster.running()) == 2,
                    timeout=60)
    cluster.kill(1, signal.SIGTERM)
    result = cluster.wait(timeout=RUN_TIMEOUT_S)
  assert result.returncodes == (0, 0), result.summary
  stopped = []
  for i, out in enumerate(result.outputs):
    line = [ln for ln in out.splitlines()
            if f'[process={i}] Preemption: all controllers stopped at step'
            in ln]
    assert line, out[-3000:]
    stopped.append(int(line[0].split('stopped at step ')[1].split(';')[0]))
  step = stopped[0]
  assert stopped == [step, step] and 50 <= step < STEPS
  assert f'Preempted: saved step {step}' in result.outputs[0]
  for layout in ('1x4', '4x1'):
    shutil.copytree(ckpt, tmp_path / f'ckpt{layout}')
    shutil.copy(metrics, tmp_path / f'metrics{layout}.jsonl')

  # Same topology: bitwise.
  resumed = _run_cluster(_train_args(ckpt, metrics, '--resume'),
                         num_processes=2, devices_per_process=2)
  assert f'Resumed from step {step} (epoch' in resumed.outputs[0]
  assert _final_digest(resumed.outputs[0]) == reference['digest']
  assert _metrics(metrics) == reference['metrics']

  # Other topologies: same ids, state within the tutorial's tolerances.
  want = _stored_state(reference['dir'])
  rc, out = _run_single(
      _train_args(tmp_path / 'ckpt1x4', tmp_path / 'metrics1x4.jsonl',
                  '--resume'), log=tmp_path / '1x4.log', devices=4)
  assert rc == 0, out[-3000:]
  _run_cluster(_train_args(tmp_path / 'ckpt4x1', tmp_path / 'metrics4x1.jsonl',
                           '--resume'), num_processes=4, devices_per_process=1)
  for layout in ('1x4', '4x1'):
    got_metrics = _metrics(tmp_path / f'metrics{layout}.jsonl')
    assert sorted(got_metrics) == list(range(1, STEPS + 1))
    for s, rec in reference['metrics'].items():
      assert got_metrics[s]['ids'] == rec['ids'], (layout, s)
      np.testing.assert_allclose(got_metrics[s]['loss'], rec['loss'],
                                 rtol=recovery.RTOL, atol=recovery.ATOL)
    got = _stored_state(tmp_path / f'ckpt{layout}')
    assert (got.step, got.epoch, got.cursor) == (want.step, want.epoch,
                                                 want.cursor)
    np.testing.assert_array_equal(got.order, want.order)
    for name in ('weights', 'momentum'):
      np.testing.assert_allclose(got.user[name], want.user[name],
                                 rtol=recovery.RTOL, atol=recovery.ATOL,
                                 err_msg=f'{layout} {name}')


# -- single controller ---------------------------------------------------------


def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(tmp_path):
  ckpt, metrics = tmp_path / 'ckpt', tmp_path / 'metrics.jsonl'
  args = [TRAIN, f'--checkpoint_dir={ckpt}', f'--metrics_out={metrics}',
          '--steps=100000', '--save_every=1', '--keep=2', '--width=4096']
  partial = []
  with _single(args, log=tmp_path / 'killed.log') as proc:
    _wait_for_lines(metrics, 5, alive=lambda: proc.poll() is None, timeout=60)
    deadline = time.monotonic() + 30
    while not partial and time.monotonic() < deadline:
      partial = [n for n in os.listdir(ckpt) if n.endswith('-tmp')]
    assert partial, 'never saw a save in progress'
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
  left = sorted(int(n.split('.')[0]) for n in os.listdir(ckpt)
                if n.endswith('.orbax-checkpoint-tmp'))
  committed = sorted(int(n) for n in os.listdir(ckpt) if n.isdigit())
  assert committed, os.listdir(ckpt)
  rc, out = _run_single([VERIFY, f'--checkpoint_dir={ckpt}'],
                        log=tmp_path / 'verify.log')
  assert rc == 0 and f'latest step {committed[-1]}.' in out, out[-3000:]
  # The kill landed inside a save: it left that step uncommitted.
  assert left and left[-1] > committed[-1], os.listdir(ckpt)
  assert f'Partial (uncommitted, ignored) saves: {left}' in out
  killed_at = max(_metrics(metrics))
  rc, out = _run_single(
      [*args[:-3], f'--steps={killed_at + 3}', '--save_every=1', '--keep=2',
       '--width=4096', '--resume'], log=tmp_path / 'resumed.log')
  assert rc == 0, out[-3000:]
  assert f'Resumed from step {committed[-1]} (epoch' in out
  assert f'Finished step {killed_at + 3} ' in out
  # _metrics checks that re-run steps were recomputed identically.
  assert sorted(_metrics(metrics)) == list(range(1, killed_at + 4))


def test_corrupt_checkpoint_is_a_clear_error_and_loses_nothing(tmp_path):
  ckpt = tmp_path / 'ckpt'
  rc, out = _run_single([TRAIN, f'--checkpoint_dir={ckpt}', '--steps=10'],
                        log=tmp_path / 'train.log')
  assert rc == 0, out[-3000:]
  for f in (ckpt / '10' / 'state').rglob('*'):
    if f.is_file() and f.parent.name == 'd':
      f.write_bytes(np.random.default_rng(0).bytes(f.stat().st_size))
  # (bin/verify_checkpoint.py's report of this damage: test_quiet.py's
  # test_verify_checkpoint_prints_its_report_and_no_noise.)
  rc, out = _run_single([TRAIN, f'--checkpoint_dir={ckpt}', '--steps=20',
                         '--resume'], log=tmp_path / 'resume.log')
  # No usable checkpoint where one is required: restarting will not help.
  assert rc == NO_RETRY, out[-3000:]
  assert re.search(r"error: \[process=0\] CheckpointDamagedError: .*step 10 .*"
                   r"cannot be read.*Start with resume='if_present'.*resume "
                   r'from the previous checkpoint \(step 5\).* Here: pass '
                   r'--resume_if_present instead of --resume', out), out[-3000:]
  # --resume sets nothing aside.
  assert sorted(n for n in os.listdir(ckpt) if n.isdigit()) == ['10', '5']
  # No traceback through our code. (Orbax may print its own, from
  # site-packages, which can be inside ROOT/.venv: a read task whose error
  # nobody retrieved, or TensorStore's 'Event loop is closed', for reads still
  # in flight when its restore failed.)
  for ours in ('multihost', 'recovery', 'bin'):
    assert f'File "{ROOT / ours}' not in out, out[-3000:]
  assert 'error: [process=0] CheckpointDamagedError' in out
  assert 'resume from the previous checkpoint (step 5)' in out
  assert 'Here: pass --resume_if_present instead of --resume.' in out
  # A checkpoint of another width is refused with the fix.
  shutil.rmtree(ckpt / '10')
  rc, out = _run_single([TRAIN, f'--checkpoint_dir={ckpt}', '--steps=20',
                         '--resume', '--width=16'], log=tmp_path / 'w.log')
  assert rc == NO_RETRY and 'does not fit this run' in out, out[-3000:]
  assert '--width' in out
  # Starting fresh in a folder that holds a checkpoint is refused.
  rc, out = _run_single([TRAIN, f'--checkpoint_dir={ckpt}', '--steps=20'],
                        log=tmp_path / 'fresh.log')
  assert rc == NO_RETRY and 'already holds checkpoint steps [5]' in out


def test_resume_if_present_and_requeues(tmp_path):
  """What a requeued job runs: resume if there is a checkpoint, else fresh."""
  ckpt = tmp_path / 'ckpt'
  args = [TRAIN, f'--checkpoint_dir={ckpt}', '--save_every=5']
  rc, out = _run_single([*args, '--steps=5', '--resume_if_present'],
                        log=tmp_path / 'first.log')
  assert rc == 0 and 'Resumed' not in out and 'Finished step 5 ' in out, out
  rc, out = _run_single([*args, '--steps=10', '--resume_if_present'],
                        log=tmp_path / 'second.log')
  assert rc == 0 and 'Resumed from step 5 (epoch' in out, out[-3000:]
  assert 'Finished step 10 ' in out, out[-3000:]
  # A requeue (Slurm sets the count) resumes with the default mode,
  requeue = {'SLURM_RESTART_COUNT': '1'}
  rc, out = _run_single([*args, '--steps=15'], log=tmp_path / 'requeue.log',
                        env=requeue)
  assert rc == 0 and 'Resumed from step 10 (epoch' in out, out[-3000:]
  # and says so when nothing is left to train.
  rc, out = _run_single([*args, '--steps=15'], log=tmp_path / 'again.log',
                        env=requeue)
  assert rc == 0 and 'Resumed from step 15 (epoch' in out, out[-3000:]
  assert 'nothing left to train' in out and 'loss None' not in out, out
  # The strict modes stay: --noresume on a folder with checkpoints,
  rc, out = _run_single([*args, '--steps=15', '--noresume'],
                        log=tmp_path / 'strict.log', env=requeue)
  assert rc == NO_RETRY and 'FolderNotFreshError' in out, out[-3000:]
  assert 'Here: pass --resume (or --resume_if_present)' in out, out[-3000:]
  # and --resume on an empty one, with this binary's flags in the advice.
  rc, out = _run_single([TRAIN, f'--checkpoint_dir={tmp_path / "empty"}',
                         '--resume'], log=tmp_path / 'empty.log', env=requeue)
  assert rc == NO_RETRY and 'nothing to resume from' in out, out[-3000:]
  assert 'Here: run without --resume for a fresh run' in out, out[-3000:]


def test_configuration_errors_exit_78_and_are_not_restarted(tmp_path):
  """Bad flags, bad usage and flags that differ across processes: status 78 (restarting will not help)."""
  # A flag's value out of bounds (absl's parsing), before JAX starts.
  rc, out = _run_single([TRAIN, '--steps=0'], log=tmp_path / 'flag.log')
  assert rc == NO_RETRY and 'FATAL Flags parsing error' in out, out[-3000:]
  # Usage: a batch that cannot be sharded over the 4 devices.
  rc, out = _run_single([TRAIN, '--batch_size=6'], log=tmp_path / 'use.log')
  assert rc == NO_RETRY and 'must be a multiple of the device count' in out
  # Processes given different --steps: every one says so and exits 78, and
  # the launcher does not restart them.
  command = (f'exec "{PY}" "{TRAIN}" --checkpoint_dir={tmp_path}/ckpt '
             '--steps=$((10 + JAX_PROCESS_ID))')
  result = launch.launch(['sh', '-c', command], num_processes=2,
                         devices_per_process=2, timeout=RUN_TIMEOUT_S,
                         grace_period=30, max_restarts=2, cwd=ROOT,
                         env=_helpers.quick_compile_env())
  assert result.returncodes == (NO_RETRY, NO_RETRY), result.summary
  assert result.restart_count == 0, result.summary
  for i in (0, 1):
    assert (f'error: [process={i}] ConsistencyError: the processes run with '
            'different flags: --steps: p0=10, p1=11.') in result.outputs[i]
  assert f'not restarted: process {result.first_failure} exited with status ' \
      f'{NO_RETRY}' in result.summary
  assert not (tmp_path / 'ckpt').exists()


def _readme_cluster_commands() -> dict[str, list[str]]:
  """The train commands of docs/launcher.md's Slurm and Open MPI examples, as printed."""
  section = (ROOT / 'docs' / 'launcher.md').read_text().split(
      '## On a cluster (Slurm, Open MPI, Kubernetes)', 1)[1].split(
          '\n## ', 1)[0]
  blocks = re.findall(r'```sh\n(.*?)```', section, re.S)
  out = {}
  for block in blocks:
    joined = block.replace('\\\n', ' ')
    for line in joined.splitlines():
      words = shlex.split(line, comments=True)
      if words and words[0] in ('srun', 'mpirun'):  # The first of each.
        out.setdefault(words[0], words[words.index('python'):])
  assert sorted(out) == ['mpirun', 'srun'], section
  return out


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _cluster_vars(kind: str, rank: int, size: int, port: int) -> dict:
  """What srun or mpirun sets for one task, on this one machine."""
  if kind == 'srun':
    return {env_lib.SLURM_JOB_ID: str(port), env_lib.SLURM_STEP_NODELIST:
            'localhost', env_lib.SLURM_NTASKS: str(size),
            env_lib.SLURM_PROCID: str(rank), env_lib.SLURM_LOCALID: str(rank)}
  return {env_lib.OMPI_HNP_URI: f'{port << 12}.0;tcp://127.0.0.1:{port}',
          env_lib.OMPI_SIZE: str(size), env_lib.OMPI_RANK: str(rank),
          env_lib.OMPI_LOCAL_RANK: str(rank),
          env_lib.OMPI_LOCAL_SIZE: str(size)}


def _submit(kind: str, command: list[str], *, folder, log_dir, size=2,
            extra: dict[str, str] | None = None) -> list[str]:
  """Runs `command` as `size` tasks of a scheduler `kind`; their outputs."""
  port = _free_port()
  args = [PY if w == 'python' else w.replace('/shared/ckpt', str(folder))
          for w in command]
  procs, logs = [], []
  try:
    for rank in range(size):
      env = {**_single_env(devices=2), env_lib.COORDINATOR_PORT: str(port),
             env_lib.JOB_SECRET: SECRET,
             **_cluster_vars(kind, rank, size, port), **(extra or {})}
      logs.append(log_dir / f'{kind}-{len(list(log_dir.iterdir()))}.log')
      with open(logs[-1], 'wb') as out:
        procs.append(subprocess.Popen(
            args, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for p in procs:
      p.wait(timeout=max(1, deadline - time.monotonic()))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait(timeout=30)
  outputs = [log.read_text() for log in logs]
  for p, out in zip(procs, outputs, strict=True):
    assert p.returncode == 0, out[-3000:]
  return outputs


SECRET = secrets.token_hex(32)


@pytest.mark.parametrize('kind', ['srun', 'mpirun'])
def test_the_cluster_examples_succeed_first_and_on_a_requeue(tmp_path, kind):
  command = _readme_cluster_commands()[kind]
  folder = tmp_path / 'ckpt'
  first = _submit(kind, [*command, '--steps=10'], folder=folder,
                  log_dir=tmp_path)
  assert 'Resumed' not in first[0] and 'Finished step 10 ' in first[0], (
      first[0][-3000:])
  # Slurm sets the restart count on a requeue; mpirun is simply run again.
  again = _submit(kind, [*command, '--steps=15'], folder=folder,
                  log_dir=tmp_path, extra={'SLURM_RESTART_COUNT': '1'}
                  if kind == 'srun' else None)
  assert 'Resumed from step 10 (epoch' in again[0], again[0][-3000:]
  assert 'Finished step 15 ' in again[0], again[0][-3000:]


def test_default_run_and_single_controller_signals(tmp_path):
  # No flags: a quick run on 4 virtual CPU devices into a fresh folder.
  env_devices = 4
  t0 = time.monotonic()
  with _single([TRAIN], log=tmp_path / 'default.log',
               devices=env_devices) as proc:
    rc = proc.wait(timeout=RUN_TIMEOUT_S)
  out = (tmp_path / 'default.log').read_text()
  assert rc == 0, out[-3000:]
  folder = out.split('Checkpoint folder: ')[1].splitlines()[0]
  try:
    assert 'Finished step 20 (epoch 2)' in out
    # A finished run removes its temporary folder and says so.
    assert 'Removed the temporary checkpoint folder' in out, out[-3000:]
    assert not os.path.exists(folder), folder
  finally:
    shutil.rmtree(folder, ignore_errors=True)
  assert time.monotonic() - t0 < 60

  # SIGTERM: saved and exit 0 (handled), or killed with --nohandle_sigterm.
  for handle in (True, False):
    ckpt, metrics = tmp_path / f'c{handle}', tmp_path / f'm{handle}.jsonl'
    args = [TRAIN, f'--checkpoint_dir={ckpt}', f'--metrics_out={metrics}',
            '--steps=100000', '--save_every=100000',
            '--handle_sigterm' if handle else '--nohandle_sigterm']
    with _single(args, log=tmp_path / f'{handle}.log') as proc:
      _wait_for_lines(metrics, 3, alive=lambda: proc.poll() is None,
                      timeout=60)
      os.kill(proc.pid, signal.SIGTERM)
      rc = proc.wait(timeout=60)
    out = (tmp_path / f'{handle}.log').read_text()
    if handle:
      assert rc == 0, out[-3000:]
      step = int(out.split('Preempted: saved step ')[1].split()[0])
      assert _stored_state(ckpt).step == step
    else:
      assert rc == -signal.SIGTERM, out[-3000:]

  # Ctrl-C: exit 130 with a clear line; committed checkpoints stay intact.
  ckpt, metrics = tmp_path / 'cint', tmp_path / 'mint.jsonl'
  args = [TRAIN, f'--checkpoint_dir={ckpt}', f'--metrics_out={metrics}',
          '--steps=100000', '--save_every=2']
  with _single(args, log=tmp_path / 'int.log') as proc:
    _wait_for_lines(metrics, 5, alive=lambda: proc.poll() is None, timeout=60)
    os.kill(proc.pid, signal.SIGINT)
    rc = proc.wait(timeout=60)
  out = (tmp_path / 'int.log').read_text()
  assert rc == 130, out[-3000:]
  assert 'Interrupted (Ctrl-C)' in out
  rc, out = _run_single([VERIFY, f'--checkpoint_dir={ckpt}'],
                        log=tmp_path / 'verify.log')
  assert rc == 0 and 'OK: ' in out, out[-3000:]


def test_ctrl_c_on_two_controllers_stops_at_an_agreed_step(tmp_path):
  """SIGINT to the launcher reaches every controller; they save one step."""
  ckpt, metrics = tmp_path / 'ckpt', tmp_path / 'm.jsonl'
  launcher = subprocess.Popen(
      [PY, '-m', 'multihost.launch', '--num_processes=2',
       '--devices_per_process=1', '--grace_period=20', '--',
       PY, TRAIN, f'--checkpoint_dir={ckpt}', f'--metrics_out={metrics}',
       '--steps=1000000', '--save_every=5'],
      cwd=ROOT, env={**os.environ, **_helpers.quick_compile_env()},
      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    _wait_for_lines(metrics, 12, alive=lambda: launcher.poll() is None,
                    timeout=90)
    launcher.send_signal(signal.SIGINT)
    out, _ = launcher.communicate(timeout=90)
  finally:
    if launcher.poll() is None:
      os.killpg(launcher.pid, signal.SIGKILL)
      launcher.wait(timeout=30)
  assert launcher.returncode == 128 + signal.SIGINT, out[-3000:]
  assert 'Interrupted by SIGINT' in out, out[-3000:]
  assert 'Ctrl-C: stopping every controller at an agreed step' in out
  saved = int(out.split('Preempted: saved step ')[1].split()[0])
  for i in (0, 1):  # Both stopped on their own, with status 0.
    assert f'[p{i}] pid' in out and 'exit status 0' in out.split(
        f'[p{i}] pid')[1].splitlines()[0], out[-2000:]
  rc, verified = _run_single([VERIFY, f'--checkpoint_dir={ckpt}'],
                             log=tmp_path / 'verify.log')
  assert rc == 0 and 'OK: ' in verified, verified[-3000:]
  latest = _stored_state(ckpt).step
  assert latest == saved
  result = _run_cluster([TRAIN, f'--checkpoint_dir={ckpt}', '--resume',
                         f'--steps={latest + 5}'], num_processes=2,
                        devices_per_process=1)
  assert f'Finished step {latest + 5}' in result.outputs[0]


def test_sigkill_of_a_controller_during_a_save_at_two_processes(tmp_path):
  """The survivor raises and exits; the previous checkpoint resumes both."""
  ckpt, metrics = tmp_path / 'ckpt', tmp_path / 'metrics.jsonl'
  args = [TRAIN, f'--checkpoint_dir={ckpt}', f'--metrics_out={metrics}',
          '--save_every=1', '--keep=2', '--width=4096']
  env = {env_lib.HEARTBEAT: '3', **_helpers.quick_compile_env()}
  with launch.Controllers([PY, *args, '--steps=100000'], num_processes=2,
                          env=env, cwd=ROOT, grace_period=60) as cluster:
    _wait_for_lines(metrics, 5, alive=lambda: all(
        rc is None for rc in cluster.returncodes), timeout=60)
    partial = []
    deadline = time.monotonic() + 30
    while not partial and time.monotonic() < deadline:
      partial = [n for n in os.listdir(ckpt) if n.endswith('-tmp')]
    assert partial, 'never saw a save in progress'
    cluster.kill(1, signal.SIGKILL)
    # The survivor must exit on its own, before wait() would stop it.
    deadline = time.monotonic() + 90
    while cluster.running() and time.monotonic() < deadline:
      time.sleep(0.2)
    still_running = cluster.running()
    result = cluster.wait(timeout=90)
  assert still_running == [], (still_running, result.summary)
  assert result.returncodes[1] == -signal.SIGKILL, result.summary
  # The survivor raised (naming process 1) and exited on its own.
  assert result.returncodes[0] not in (None, 0), result.summary
  assert 'stopped by the launcher' not in result.summary, result.summary
  assert re.search(r'ProcessFailureError: .*process\(es\) \[1\]',
                   result.outputs[0]), result.outputs[0][-3000:]
  committed = sorted(int(n) for n in os.listdir(ckpt) if n.isdigit())
  rc, out = _run_single([VERIFY, f'--checkpoint_dir={ckpt}'],
                        log=tmp_path / 'verify.log')
  assert rc == 0 and f'latest step {committed[-1]}.' in out, out[-3000:]
  killed_at = max(_metrics(metrics))
  resumed = _run_cluster([*args, f'--steps={killed_at + 3}', '--resume'],
                         num_processes=2, devices_per_process=1)
  assert f'Resumed from step {committed[-1]} (epoch' in resumed.outputs[0]
  assert f'Finished step {killed_at + 3} ' in resumed.outputs[0]
  # _metrics checks that re-run steps were recomputed identically.
  assert sorted(_metrics(metrics)) == list(range(1, killed_at + 4))


# -- a damaged checkpoint under --max_restarts ----------------------------------


def _restarting(directory, metrics, *extra):
  """bin/train.py on 2 controllers under --max_restarts=1; (result, output of all attempts)."""
  args = [TRAIN, f'--checkpoint_dir={directory}', f'--metrics_out={metrics}',
          '--steps=20', '--save_every=5', '--keep=3', '--noasync_save',
          *extra]
  result = launch.launch([PY, *args], num_processes=2, devices_per_process=1,
                         grace_period=1, kill_wait=0.5, timeout=RUN_TIMEOUT_S,
                         max_restarts=1, cwd=ROOT,
                         env=_helpers.quick_compile_env())
  out = '\n'.join(o for a in result.attempts for o in a.outputs)
  assert result.ok, result.summary + '\n' + out[-4000:]
  assert not any(os.path.exists(f'/proc/{pid}') for a in result.attempts
                 for pid in a.pids)
  return result, out


def test_a_restart_sets_a_damaged_newest_checkpoint_aside_and_loses_nothing(
    tmp_path):
  """Process 1 damages step 10 and dies after step 12; the restart resumes from 5."""
  _, reference = _restarting(tmp_path / 'ref', tmp_path / 'ref.jsonl')
  ckpt, metrics = tmp_path / 'ckpt', tmp_path / 'metrics.jsonl'
  t0 = time.monotonic()
  result, out = _restarting(ckpt, metrics, '--drill_kill_after_step=12',
                            '--drill_kill_process=1', '--drill_damage_newest')
  took = time.monotonic() - t0
  assert result.restart_count == 1, result.summary
  assert 'Drill: damaged step 10 in' in out and 'SIGKILLs itself' in out
  assert _final_digest(out) == _final_digest(reference)
  (moved,) = [n for n in os.listdir(ckpt) if '.damaged-' in n]
  assert re.fullmatch(r'10\.damaged-\d{8}T\d{6}Z', moved), moved
  for p in (0, 1):  # One line each, naming the step, why, where, instead.
    lines = re.findall(rf'\[process={p}\] Checkpoint step 10 in .*', out)
    assert len(lines) == 1, lines
    assert re.search(
        rf'step 10 in {re.escape(str(ckpt))} is damaged: its files cannot be '
        r'read \(.*\)\. Set it aside as '
        rf'{re.escape(str(ckpt / moved))} \(kept, never read or deleted\); '
        r'resuming from persistent step 5 instead\.', lines[0]), lines[0]
    assert f'[process={p}] Resumed from step 5 (epoch' in out
  assert sorted(int(n) for n in os.listdir(ckpt) if n.isdigit()) == [
      10, 15, 20]
  assert {'event': 'set_aside', 'step': 10, 'tier': 'persistent',
          'moved_to': str(ckpt / moved), 'resumed_from': 5} in [
              json.loads(ln) for ln in metrics.read_text().splitlines()]
  # _metrics checks that steps 6-12, run twice, were recomputed identically.
  assert sorted(_metrics(metrics)) == list(range(1, 21))
  print(f'damaged-checkpoint drill: {took:.1f} s (both attempts)')


def test_without_checkpoint_dir_the_temporary_folder_goes_when_done(tmp_path):
  # The folder bin/train.py makes itself: removed at a finished run, said
  # so; kept (and said where, and how to continue) when the run stops short.
  temp = tmp_path / 'temp'
  temp.mkdir()
  env = {'TMPDIR': str(temp)}
  rc, out = _run_single([TRAIN, '--steps=6', '--save_every=3'],
                        log=tmp_path / 'done.log', env=env)
  assert rc == 0, out[-3000:]
  (made,) = re.findall(r'Checkpoint folder: (\S+)', out)
  assert os.path.dirname(made) == str(temp), made
  assert f'Removed the temporary checkpoint folder {made} (give ' in out
  assert os.listdir(temp) == [], os.listdir(temp)
  metrics = tmp_path / 'm.jsonl'
  with _single([TRAIN, '--steps=100000', '--save_every=2',
                f'--metrics_out={metrics}'], log=tmp_path / 'int.log',
               env=env) as proc:
    _wait_for_lines(metrics, 5, alive=lambda: proc.poll() is None,
                    timeout=RUN_TIMEOUT_S)
    os.kill(proc.pid, signal.SIGINT)
    rc = proc.wait(timeout=60)
  out = (tmp_path / 'int.log').read_text()
  assert rc == 130, out[-3000:]
  (kept,) = re.findall(r'Checkpoint folder: (\S+)', out)
  assert (f'Kept the temporary checkpoint folder {kept}: the run did not '
          f'finish; continue it with --checkpoint_dir={kept} --resume') in out
  assert os.path.isdir(kept) and os.listdir(temp) == [os.path.basename(kept)]
