"""The Python examples of README.md and the guides (docs/*.md), as printed.

Every ```python block is run by a test here (`RUN`, by a phrase of the
block) or listed in `NOT_RUN` with the reason; a new block that is neither
fails `test_every_python_block_is_run_or_has_a_reason`.

docs/recovery.md's "Using recovery in your training code" program: trained to step 30 and stopped, then the same command resumed to step 50
(saying so): the same final loss, bitwise, as an uninterrupted run to 50 on
the same topology (one controller, 4 devices); the step-30 checkpoint
resumed at 2 controllers x 2 devices ends within recovery's tolerances; run
once more, it resumes at 50 and says there is nothing left to train.

Its mixed-precision variant (bfloat16 params and Adam moments, the block
after it) stops at 30 and resumes to 50 bitwise like an uninterrupted run,
and bin/verify_checkpoint.py checks its checkpoints.

The drop-in swap (README.md, docs/migrating.md) runs in 2 controllers, and
so does the same program with JAX's import: both print the same lines. The
`jax.monitoring` listener (docs/observability.md) prints a collective's
metrics. The pytest example (docs/pytest.md) passes under pytest.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import _helpers
import numpy as np

from multihost import env as env_lib
from multihost import launch
import recovery

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY = sys.executable
HEADING = '## Using recovery in your training code'
PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md')),
         *sorted((ROOT / 'docs' / 'api').glob('*.md'))]
# A phrase of the block -> the test here that runs it.
RUN = {
    '"""python train_example.py CHECKPOINT_DIR STEPS"""':
        'test_readme_example_stops_and_resumes',
    '# Before: from jax.experimental.multihost_utils import (':
        'test_the_swap_example_prints_what_jax_prints',
    'monitoring.register_event_duration_secs_listener(on_duration)':
        'test_the_metrics_listener_prints_a_collective',
    '@pytest.mark.multihost(num_processes=2, devices_per_process=2)':
        'test_the_pytest_example_passes',
    'mu_dtype=jnp.bfloat16))':
        'test_the_mixed_precision_variant_resumes_bitwise_and_verifies',
}
# A phrase of the block -> why no test here runs it.
NOT_RUN = {
    'recovery.EpochSampler(num_samples, batch_size)':
        'a sketch of the loop: step_fn, make_batch, user_state, directory '
        'are the reader\'s; docs/recovery.md\'s complete program runs here',
    'hosts = multihost.allgather_object(socket.gethostname())':
        'a tour of the calls on the reader\'s params, loss, state and cfg; '
        'tests/multiprocess/test_collectives.py runs each collective',
    'before_exit=lambda failed: save_local_state()':
        'settings of a job whose peer dies (save_local_state is the '
        'reader\'s); tests/unit/test_peer_loss_exit.py runs them',
    'watch = multihost.step_watch()':
        'the shape of a training loop (loader, train_step, save_or_evaluate '
        'are the reader\'s); tests/multiprocess/test_step_deadline_drills.py '
        'drills the deadline',
    'local_directory=\'/local/ckpt\'':
        'a fragment (shared_dir, initial are the reader\'s, /local/ckpt a '
        'host\'s disk); tests/multiprocess/test_local_tier_processes.py runs '
        'the local tier through bin/train.py',
}
TIMEOUT_S = 180
# Cluster variables a single-controller run must not inherit.
_CLUSTER_VARS = (env_lib.COORDINATOR, env_lib.NUM_PROCESSES,
                 env_lib.PROCESS_ID, env_lib.OMPI_HNP_URI, env_lib.OMPI_SIZE,
                 env_lib.SLURM_JOB_ID)


def python_blocks() -> list[tuple[pathlib.Path, str]]:
  """Every ```python block of README.md and the guides, with its page."""
  return [(page.relative_to(ROOT), block) for page in PAGES
          for block in re.findall(r'^ *```python\n(.*?)^ *```',
                                  page.read_text(), re.S | re.M)]


def _block(phrase: str) -> str:
  """The block that contains `phrase`; every copy of it must be the same."""
  found = {block for _, block in python_blocks() if phrase in block}
  assert len(found) == 1, (phrase, found)
  return found.pop()


def test_every_python_block_is_run_or_has_a_reason():
  for page, block in python_blocks():
    run = [p for p in RUN if p in block]
    why = [p for p in NOT_RUN if p in block]
    assert len(run) + len(why) == 1, (
        f'{page}: a Python block is neither run here nor listed in NOT_RUN '
        f'(or both):\n{block}')
  for phrase in (*RUN, *NOT_RUN):
    assert any(phrase in b for _, b in python_blocks()), (
        f'{phrase!r} is in no block any more')
  for name in RUN.values():
    assert callable(globals().get(name)), name


def _example() -> str:
  section = (ROOT / 'docs' / 'recovery.md').read_text().split(HEADING, 1)[1]
  return re.search(r'```python\n(.*?)```', section, re.S).group(1)


def test_the_swap_example_prints_what_jax_prints(tmp_path):
  ours = _block('# Before: from jax.experimental.multihost_utils import (')
  theirs = ours.replace('\nfrom multihost import (\n',
                        '\nfrom jax.experimental.multihost_utils import (\n')
  theirs = theirs.replace('\nmultihost.initialize()',
                          '\njax.distributed.initialize()')
  assert theirs.count('jax.experimental.multihost_utils import') == 2, theirs
  printed = []
  for name, text in (('swap_example.py', ours), ('jax_example.py', theirs)):
    (tmp_path / name).write_text(text)
    result = launch.launch([PY, str(tmp_path / name)], num_processes=2,
                           timeout=TIMEOUT_S, cwd=tmp_path,
                           env=_helpers.quick_compile_env())
    assert result.ok, result.summary + result.outputs[0][-3000:]
    printed.append([[ln for ln in out.splitlines()
                     if ln.startswith('process ')] for out in result.outputs])
  assert printed[0] == [['process 0: seed 1234, ids [0, 1]'],
                        ['process 1: seed 1234, ids [0, 1]']], printed
  assert printed[1] == printed[0]


def test_the_metrics_listener_prints_a_collective(tmp_path):
  block = _block('monitoring.register_event_duration_secs_listener(on_duration)')
  script = tmp_path / 'listener.py'
  script.write_text(block + '\nimport multihost\nimport numpy as np\n\n'
                    'multihost.broadcast_one_to_all(np.int32(1))\n')
  out = _single(script)
  for event in ('duration_secs', 'wait_secs', 'bytes'):
    assert (f"/multihost/collective/{event} {{'op': 'broadcast_one_to_all'}}"
            in out), out


def test_the_pytest_example_passes(tmp_path):
  (tmp_path / 'test_example.py').write_text(
      _block('@pytest.mark.multihost(num_processes=2, devices_per_process=2)'))
  # A user's pytest: none of this pytest's (or its xdist worker's) variables.
  env = {k: v for k, v in os.environ.items()
         if k not in _CLUSTER_VARS + recovery.RESTART_COUNT_VARIABLES
         and not k.startswith('PYTEST_')}
  env.update({env_lib.PLATFORMS: 'cpu', **_helpers.quick_compile_env()})
  proc = subprocess.run(
      [PY, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-p', 'no:xdist',
       'test_example.py'], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
      capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert '1 passed' in proc.stdout, proc.stdout[-3000:]


def _final(output: str) -> tuple[int, float]:
  line = [ln for ln in output.splitlines() if ln.startswith('step ')][-1]
  step, loss = re.fullmatch(r'step (\d+) loss (\S+)', line).groups()
  return int(step), float(loss)


def _resumed(output: str) -> int | None:
  found = re.findall(r'^resumed from step (\d+)$', output, re.M)
  return int(found[-1]) if found else None


def _single(script, *args) -> str:
  env = {k: v for k, v in os.environ.items()
         if k not in _CLUSTER_VARS + recovery.RESTART_COUNT_VARIABLES}
  env.update({env_lib.NUM_CPU_DEVICES: '4', env_lib.PLATFORMS: 'cpu',
              **_helpers.quick_compile_env()})
  proc = subprocess.run([PY, str(script), *map(str, args)], env=env, cwd=ROOT,
                        stdin=subprocess.DEVNULL, capture_output=True,
                        text=True, timeout=TIMEOUT_S, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def test_readme_example_stops_and_resumes(tmp_path):
  script = tmp_path / 'train_example.py'
  script.write_text(_example())
  first = _single(script, tmp_path / 'run', 30)
  assert _resumed(first) is None and _final(first)[0] == 30
  shutil.copytree(tmp_path / 'run', tmp_path / 'run2x2')
  out = _single(script, tmp_path / 'run', 50)
  assert _resumed(out) == 30, out
  resumed = _final(out)
  uninterrupted = _final(_single(script, tmp_path / 'ref', 50))
  assert resumed == uninterrupted and resumed[0] == 50
  result = launch.launch(
      [PY, str(script), str(tmp_path / 'run2x2'), '50'],
      num_processes=2, devices_per_process=2, timeout=TIMEOUT_S, cwd=ROOT,
      env=_helpers.quick_compile_env())
  assert result.ok, result.summary + result.outputs[0][-3000:]
  assert _resumed(result.outputs[0]) == 30, result.outputs[0][-3000:]
  step, loss = _final(result.outputs[0])
  assert step == 50
  np.testing.assert_allclose(loss, uninterrupted[1], rtol=recovery.RTOL,
                             atol=recovery.ATOL)
  done = _single(script, tmp_path / 'run', 50)
  assert _resumed(done) == 50, done
  assert 'step 50: nothing left to train' in done and 'None' not in done, done


def test_the_mixed_precision_variant_resumes_bitwise_and_verifies(tmp_path):
  variant = _block('mu_dtype=jnp.bfloat16))')
  program, count = re.subn(r'^params = .*?(?=^state = )', lambda _: variant,
                           _example(), count=1, flags=re.S | re.M)
  assert count == 1 and 'mu_dtype' in program, program
  script = tmp_path / 'mixed_example.py'
  script.write_text(program)
  first = _single(script, tmp_path / 'run', 30)
  assert _resumed(first) is None and _final(first)[0] == 30
  out = _single(script, tmp_path / 'run', 50)
  assert _resumed(out) == 30, out
  assert _final(out) == _final(_single(script, tmp_path / 'ref', 50))
  with recovery.Checkpoints(tmp_path / 'run', read_only=True) as ckpt:
    dtypes = {k: v[1] for k, v in ckpt.read_meta(50)['leaves'].items()}
  # The 4 params and Adam's 4 + 4 moments are bfloat16 (nu follows the
  # params), the step counts int32.
  low = sorted(k for k, v in dtypes.items() if v == 'bfloat16')
  assert len(low) == 12 and all(
      re.search(r'/(mu|nu)/params/', k) or k.startswith('user/params/')
      for k in low), dtypes
  done = subprocess.run(
      [PY, str(ROOT / 'bin' / 'verify_checkpoint.py'),
       f'--checkpoint_dir={tmp_path / "run"}'],
      capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
      env={**os.environ, env_lib.PLATFORMS: 'cpu'}, stdin=subprocess.DEVNULL)
  assert done.returncode == 0, done.stdout + done.stderr
  assert re.search(r'^step 50: OK .*user/params/params/Dense_1/kernel '
                   r'\(8, 32\) bfloat16', done.stdout, re.M), done.stdout
  assert 'OK: 3 checkpoints verified; latest step 50.' in done.stdout, (
      done.stdout)
