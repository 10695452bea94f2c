"""Quiet runs: no third-party line without an action, one line per event.

The binaries run as a user runs them (real controllers, real signals, real
checkpoints); each test also checks that the real message, or a real error,
still shows. The filters themselves are checked on the records and
unraisable exceptions they drop and on their neighbours that they must keep.
"""

from __future__ import annotations

import asyncio
import collections
import logging as std_logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import types

import _helpers
from absl import logging
import numpy as np

from multihost import env as env_lib
from multihost import launch
import recovery
from recovery._src.run import quiet

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / 'bin' / 'train.py')
VERIFY = str(ROOT / 'bin' / 'verify_checkpoint.py')
PY = sys.executable
TIMEOUT_S = 120
ADVICE = 'WaitAtBarrier'  # JAX's C++ line at a recoverable service's start.
ORBAX_PREEMPTION = 'Reached preemption sync point'
# absl's line header (level, date, time, thread) or the launcher's [pN].
_HEADER = re.compile(r'^(\[p\d+\] )?([IWEF]\d{4} [\d:.]+ +\d+ )?')
_CLUSTER_VARS = (env_lib.COORDINATOR, env_lib.NUM_PROCESSES,
                 env_lib.PROCESS_ID, env_lib.OMPI_HNP_URI, env_lib.OMPI_SIZE,
                 env_lib.SLURM_JOB_ID, *recovery.RESTART_COUNT_VARIABLES,
                 quiet.CPP_LOG_LEVEL)


def _env(**extra: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_VARS}
  env.update({env_lib.PLATFORMS: 'cpu', env_lib.NUM_CPU_DEVICES: '4',
              env_lib.PYTHON_UNBUFFERED: '1', **_helpers.quick_compile_env()},
             **extra)
  return env


def _run(args, *, timeout: float = TIMEOUT_S, **env: str):
  done = subprocess.run([PY, *args], cwd=ROOT, env=_env(**env),
                        stdin=subprocess.DEVNULL, capture_output=True,
                        text=True, timeout=timeout)
  return done.returncode, done.stdout + done.stderr


def _repeated(output: str) -> list[str]:
  """Lines of one process's output told more than once (headers aside)."""
  lines = [_HEADER.sub('', ln).split('] ', 1)[-1]
           for ln in output.splitlines() if ln.strip()]
  return [ln for ln, n in collections.Counter(lines).items() if n > 1]


def _wait_for(path: pathlib.Path, lines: int, alive) -> None:
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline:
    if path.exists() and path.read_text().count('\n') >= lines:
      return
    assert alive(), f'the run ended before {path} had {lines} lines'
    time.sleep(0.05)
  raise AssertionError(f'{path} did not reach {lines} lines in 60 s')


def test_a_2x2_run_is_quiet_and_tells_a_preemption_once(tmp_path):
  """No C++ advice, no Orbax echo, no line twice on any process."""
  ckpt, metrics = tmp_path / 'ckpt', tmp_path / 'm.jsonl'
  command = [PY, TRAIN, f'--checkpoint_dir={ckpt}', '--steps=100000',
             f'--metrics_out={metrics}', '--progress_every=0.5']
  with launch.Controllers(command, num_processes=2, devices_per_process=2,
                          cwd=ROOT, env=_env()) as cluster:
    _wait_for(metrics, 20, alive=lambda: len(cluster.running()) == 2)
    cluster.kill(1, signal.SIGTERM)
    result = cluster.wait(timeout=TIMEOUT_S)
  assert result.returncodes == (0, 0), result.summary + ''.join(
      f'\n[p{i}] ...{out[-3000:]}' for i, out in enumerate(result.outputs))
  everything = '\n'.join(result.outputs)
  assert ADVICE not in everything, everything[-3000:]
  assert ORBAX_PREEMPTION not in everything, everything[-3000:]
  assert not _helpers.gloo_lines(everything), everything[-3000:]
  for i, out in enumerate(result.outputs):
    assert out.count(f'[process={i}] Preemption: all controllers stopped '
                     'at step') == 1, out[-3000:]
    assert _repeated(out) == [], out[-3000:]
  assert result.outputs[0].count('Preempted: saved step') == 1
  # Progress lines: process 0 tells them for all.
  assert '[process=0] step ' in result.outputs[0], result.outputs[0][-3000:]
  assert '[process=1] step ' not in result.outputs[1]


def test_the_cpp_advice_is_hidden_only_inside_the_block():
  """Inside: the advice is gone; after it, C++ warnings show again; and
  TF_CPP_MIN_LOG_LEVEL=0 keeps them inside too."""
  script = (
      'import recovery\n'
      'from multihost import lowlevel\n'
      'def service(name):\n'
      '  print(name, flush=True)\n'
      '  return lowlevel.start_service("127.0.0.1:0", 1, '
      'heartbeat_timeout=10)\n'
      'with recovery.cpp_warnings_hidden():\n'
      '  inside = service("INSIDE")\n'
      'after = service("AFTER")\n'
      'print("END", flush=True)\n'
      'inside.shutdown(); after.shutdown()\n')
  rc, out = _run(['-c', script], timeout=60)
  assert rc == 0, out
  # stderr follows stdout in `out`: count the advice lines.
  assert out.count(ADVICE) == 1, out
  rc, out = _run(['-c', script], timeout=60, **{quiet.CPP_LOG_LEVEL: '0'})
  assert rc == 0 and out.count(ADVICE) == 2, out


def _corrupt(step_dir: pathlib.Path) -> None:
  for f in step_dir.rglob('*'):
    if f.is_file() and f.parent.name == 'd':
      f.write_bytes(np.random.default_rng(0).bytes(f.stat().st_size))


def test_verify_checkpoint_prints_its_report_and_no_noise(tmp_path):
  ckpt = tmp_path / 'ckpt'
  rc, out = _run([TRAIN, f'--checkpoint_dir={ckpt}', '--steps=10'])
  assert rc == 0, out[-3000:]
  rc, out = _run([VERIFY, f'--checkpoint_dir={ckpt}'])
  assert rc == 0, out
  assert out.splitlines() == [
      f'Checkpoint folder: {ckpt}', 'Committed steps: [5, 10]',
      *[ln for ln in out.splitlines() if ln.startswith('step ')],
      'OK: 2 checkpoints verified; latest step 10.'], out
  assert len([ln for ln in out.splitlines() if ': OK ' in ln]) == 2
  # A damaged step: its one FAIL line, and none of the reads' echoes (they
  # race with Orbax's closing loop, so a few runs).
  _corrupt(ckpt / '10' / 'state')
  for _ in range(3):
    rc, out = _run([VERIFY, f'--checkpoint_dir={ckpt}'])
    assert rc == 1, out
    assert 'step 5: OK' in out and out.count('step 10: FAIL') == 1, out
    for noise in ('read only', 'Event loop is closed', 'never retrieved',
                  'Traceback'):
      assert noise not in out, out
  # --verbosity=1 brings every line back.
  rc, out = _run([VERIFY, f'--checkpoint_dir={ckpt}', '--verbosity=1'])
  assert rc == 1 and 'Given directory is read only' in out, out[-3000:]


def test_ctrl_c_and_errors_on_a_single_controller_say_it_once(tmp_path):
  ckpt, metrics = tmp_path / 'ckpt', tmp_path / 'm.jsonl'
  with open(tmp_path / 'int.log', 'wb') as log:
    proc = subprocess.Popen(
        [PY, TRAIN, f'--checkpoint_dir={ckpt}', '--steps=100000',
         '--save_every=2', f'--metrics_out={metrics}'], cwd=ROOT, env=_env(),
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
  try:
    _wait_for(metrics, 5, alive=lambda: proc.poll() is None)
    os.kill(proc.pid, signal.SIGINT)
    rc = proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait(timeout=30)
  out = (tmp_path / 'int.log').read_text()
  assert rc == 130, out[-3000:]
  assert out.count('Interrupted (Ctrl-C)') == 1, out[-3000:]
  assert re.search(r'error: \[process=0\] Interrupted \(Ctrl-C\) after step '
                   r'\d+; the last committed checkpoint is step \d+\. '
                   r'Committed checkpoints in .* are intact; relaunch with '
                   r'--resume_if_present', out), out[-3000:]
  assert _repeated(out) == [], out[-3000:]
  # A real error: shown once, with the fix.
  rc, out = _run([TRAIN, f'--checkpoint_dir={tmp_path / "empty"}',
                  '--resume'])
  assert rc == env_lib.NO_RETRY_EXIT_STATUS, out[-3000:]
  assert out.count('NothingToResumeError') == 1, out[-3000:]


def test_the_filters_drop_only_their_lines(monkeypatch):
  """Each filter on the record it drops and on neighbours it must keep."""
  handler = logging.get_absl_handler()
  seen = []
  monkeypatch.setattr(sys, 'unraisablehook', seen.append)
  monkeypatch.setattr(quiet, '_INSTALLED', threading.Event())
  recovery.quiet_third_party_noise()
  monkeypatch.setattr(logging, 'get_verbosity', lambda: logging.INFO)
  try:
    orbax = os.path.join(os.sep, 'x', 'orbax', 'checkpoint', 'm.py')

    def record(name, level, msg, pathname, exc=None, args=()):
      return std_logging.LogRecord(
          name, level, pathname, 1, msg, args, (type(exc), exc, None)
          if exc else None)

    jax_distributed = os.path.join(os.sep, 'x', 'jax', '_src',
                                   'distributed.py')
    said_by_all = ('multihost failure watchdog started: a killed peer ...',
                   'jax.distributed initialized: 2 processes, 2 local devices.',
                   'Resuming from local step 30 in /l (...)',
                   'Resuming from checkpoint step 30 in /c (...).',
                   'Restored local step 30 (epoch 3, cursor 48) ...')

    ts_error = ValueError('DATA_LOSS: ... [tensorstore_spec=\'{}\']')
    dropped = [
        record('absl', std_logging.WARNING,
               'Given directory is read only=%s', orbax),
        record('absl', std_logging.WARNING, '[process=%s][thread=%s] '
               'Reached preemption sync point, step=%s', orbax),
        record('jax._src.xla_bridge', std_logging.INFO,
               "Unable to initialize backend '%s': %s", '/jax/xla_bridge.py'),
        record('asyncio', std_logging.ERROR,
               'Task exception was never retrieved\nfuture: ...',
               '/asyncio/base_events.py', ts_error),
        record('asyncio', std_logging.ERROR,
               'Future exception was never retrieved\nfuture: ...',
               '/asyncio/base_events.py', ts_error),
        record('asyncio', std_logging.ERROR,
               '_GatheringFuture exception was never retrieved\nfuture: ...',
               '/asyncio/base_events.py', ts_error),
        record('absl', std_logging.INFO,
               'JAX distributed initialized with visible devices: %s',
               jax_distributed, args=(1,)),
        record('absl', std_logging.INFO,
               'Connecting to JAX distributed service on %s', jax_distributed,
               args=('127.0.0.1:1',)),
        *(record('absl', std_logging.INFO, '%s ' + said, '/m/runtime.py',
                 args=('[process=1]',))
          for said in said_by_all),
        record('absl', std_logging.WARNING, '%s %s holds uncommitted '
               '(partial) saves of steps %s, ...', '/r/checkpoints.py',
               args=('[process=1]', '/c', [30])),
    ]
    kept = [
        record('absl', std_logging.WARNING, 'Given directory is read only',
               '/elsewhere/m.py'),
        record('absl', std_logging.WARNING, 'Some other Orbax warning', orbax),
        record('jax._src.xla_bridge', std_logging.WARNING,
               "Unable to initialize backend '%s': %s", '/jax/xla_bridge.py'),
        record('asyncio', std_logging.ERROR,
               'Task exception was never retrieved\nfuture: ...',
               '/asyncio/base_events.py', ValueError('a real bug')),
        record('asyncio', std_logging.ERROR,
               'Future exception was never retrieved\nfuture: ...',
               '/asyncio/base_events.py', ValueError('a real bug')),
        record('asyncio', std_logging.ERROR,
               '_GatheringFuture exception was never retrieved\nfuture: ...',
               '/asyncio/base_events.py', ValueError('a real bug')),
        record('absl', std_logging.INFO,
               'Starting JAX distributed service on %s', jax_distributed,
               args=('127.0.0.1:1',)),
        record('absl', std_logging.WARNING,
               'Connecting to JAX distributed service on %s', jax_distributed,
               args=('127.0.0.1:1',)),
        # Process 0 tells them for all; a warning shows on every process.
        *(record('absl', std_logging.INFO, '%s ' + said, '/m/runtime.py',
                 args=('[process=0]',))
          for said in said_by_all),
        record('absl', std_logging.WARNING, '%s ' + said_by_all[0],
               '/m/runtime.py', args=('[process=1]',)),
        record('absl', std_logging.INFO, '%s step 5/10 loss %g',
               '/m/loop.py', args=('[process=1]', 0.5)),
        record('absl', std_logging.WARNING, '%s %s holds uncommitted '
               '(partial) saves of steps %s, ...', '/r/checkpoints.py',
               args=('[process=0]', '/c', [30])),
    ]
    assert [handler.filter(r) for r in dropped] == [False] * len(dropped)
    assert [handler.filter(r) for r in kept] == [True] * len(kept)

    loop = asyncio.new_event_loop()
    loop.close()

    def unraisable(exc):
      return types.SimpleNamespace(exc_type=type(exc), exc_value=exc,
                                   exc_traceback=exc.__traceback__,
                                   err_msg=None, object=None)

    try:
      loop.call_soon_threadsafe(print)
    except RuntimeError as e:
      from_ours = e  # Raised with this test's frame on the stack.
    # As from TensorStore's thread: asyncio's frames only.
    from_c = RuntimeError('Event loop is closed').with_traceback(
        from_ours.__traceback__.tb_next)
    sys.unraisablehook(unraisable(from_c))
    assert seen == []
    for other in (from_ours, RuntimeError('Event loop is closed'),
                  ValueError('other')):
      sys.unraisablehook(unraisable(other))
    assert len(seen) == 3
    # With --verbosity=1 nothing is dropped.
    monkeypatch.setattr(logging, 'get_verbosity', lambda: logging.DEBUG)
    assert all(handler.filter(r) for r in dropped)
    sys.unraisablehook(unraisable(from_c))
    assert len(seen) == 4
  finally:
    handler.removeFilter(quiet._keep)
