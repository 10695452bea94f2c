"""The docs' shell blocks run as printed, in an activated venv, as a user runs them.

Every ```sh and ```bash block of README.md and of the guides (docs/*.md,
docs/api/*.md) is either run here or listed in `NOT_RUN` with the reason; a
new block that is neither fails `test_every_block_is_run_or_has_a_reason`. A block runs as one bash script
(`set -euo pipefail`) in a temporary folder that holds the clone's `bin/`,
with the venv activated as the quick start does (its `bin/` first on PATH,
VIRTUAL_ENV set) and no cluster variable. Three changes fit it into CI's
budget and keep runs apart: `/tmp/` becomes the test's own folder, the
`--steps=` of the launcher example shrink (`STEPS`), and the blocks' JAX
processes compile less (`_helpers.quick_compile_env`). Commands that
cannot run here are dropped from a block by `SKIPPED_COMMANDS`, with the
reason.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap

import _helpers
import pytest

from multihost import env as env_lib
import recovery

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV_BIN = pathlib.Path(sys.executable).parent
BLOCK_TIMEOUT_S = 240

# A phrase of the block -> why the block is not run here.
NOT_RUN = {
    'srun python train.py': 'a Slurm job: srun, and a secret file in $HOME '
                            'named by $SLURM_JOB_ID',
    '#SBATCH': 'a Slurm batch script: tests/multiprocess/test_train.py::test_the_cluster_'
               'examples_succeed_first_and_on_a_requeue runs its srun command '
               'with Slurm\'s variables',
    'mpirun -np': 'needs mpirun and a hostfile: tests/multiprocess/test_train.py::test_the_'
                  'cluster_examples_succeed_first_and_on_a_requeue runs its '
                  'command with Open MPI\'s variables',
    'bin/bench.py': 'the full benchmark takes minutes; tests/multiprocess/test_bench.py '
                    'runs it on small sizes',
    'bench/restart_drill.py': 'a measurement: 3 restart drills of about a '
                              'minute each per command; tests/multiprocess/'
                              'test_launch_restarts.py drills the restarts',
    'bench/cpu_share.py': 'a measurement: 9 rounds at P=8 with torch gloo '
                          'beside, about a minute; tests/multiprocess/'
                          'test_bench.py runs it at 3 processes',
    'bench/scale_costs.py': 'a measurement: every collective, save and '
                            'restore at P=2-16 on simulated hosts (root), '
                            '3-4 minutes; tests/multiprocess/test_bench.py '
                            'runs it at 2 processes',
    'bench/compile_cache.py': 'a measurement: a 400-layer model whose '
                              'compiles take 25-35 s per process and attempt',
    '--width=8388608': 'a synopsis ([--local_checkpoint_dir=...] is '
                       'optional) and a minute per run; tests/multiprocess/'
                       'test_local_tier_processes.py runs the local tier',
    'MULTIHOST_NETNS_PRIVATE_FOLDER': 'simulated hosts need root, `ip` and '
                                      '`unshare`; tests/multiprocess/'
                                      'test_local_netns.py runs this drill '
                                      'where they are',
    '--num_processes=N': 'a synopsis (N, K, S are placeholders)',
    'docs/restart.sbatch': 'Slurm jobs (and a 2000-step run); tests/multiprocess/'
                           'test_slurm_real.py runs them under a real Slurm '
                           'where it can (root, .ci/slurm), and '
                           'test_slurm_restarts.py the recipe with a stand-in '
                           'srun',
    'bin/plot.py': 'regenerates the committed pictures in docs/; '
                   'tests/unit/test_plot.py draws all three kinds from files it '
                   'writes',
}
# A command's start -> why it is dropped from a block that runs.
SKIPPED_COMMANDS = {
    'python3 -m venv': 'makes the venv this test already runs in (.ci/run '
                       'makes it in CI)',
    'source .venv/bin/activate': 'the test runs every block with the venv '
                                 'activated',
    'pip install': 'CI installs the package and its test extras (.ci/run)',
    'python -m pytest tests': 'the whole suite, of which this test is part',
}
# The launcher example's --steps=, in order: a short run, then a resume that
# still trains (600 and 600 would take a minute and resume nothing).
STEPS = {'--steps=600': ['--steps=30', '--steps=40']}
# Blocks that must be among those run (by a phrase): the quick start's
# training, the launcher example with its resume and check, the Open MPI
# variables tried by hand.
MUST_RUN = ('python bin/train.py\n', '--devices_per_process=1 --',
            'OMPI_COMM_WORLD_RANK=1')
_CLUSTER_VARS = (env_lib.COORDINATOR, env_lib.NUM_PROCESSES,
                 env_lib.PROCESS_ID, env_lib.OMPI_HNP_URI, env_lib.OMPI_SIZE,
                 env_lib.OMPI_RANK, env_lib.OMPI_LOCAL_RANK,
                 env_lib.SLURM_JOB_ID, env_lib.COORDINATOR_PORT,
                 *recovery.RESTART_COUNT_VARIABLES, 'PYTHONPATH')


# README.md first (its quick start is the first block), then the guides.
PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md')),
         *sorted((ROOT / 'docs' / 'api').glob('*.md'))]


def blocks(text: str) -> list[str]:
  """A page's shell blocks, in order (also those indented in a list)."""
  return [textwrap.dedent(b) for b in re.findall(
      r'^( *)```(?:sh|bash)\n(.*?)^\1```', text, re.S | re.M)
          for b in [b[1].replace('\n' + b[0], '\n').removeprefix(b[0])]]


def reason_not_run(block: str) -> str | None:
  return next((why for phrase, why in NOT_RUN.items() if phrase in block),
              None)


def script(block: str, tmp: pathlib.Path) -> str:
  """The block as it runs here: skipped commands out, /tmp/ and steps moved."""
  lines = []
  for line in block.splitlines():
    parts = [p for p in line.split(' && ')
             if not p.lstrip().startswith(tuple(SKIPPED_COMMANDS))]
    if parts:
      lines.append(' && '.join(parts))
  text = '\n'.join(lines) + '\n'
  for old, news in STEPS.items():
    for new in news:
      text = text.replace(old, new, 1)
  return text.replace('/tmp/', f'{tmp}/')


def _env(tmp: pathlib.Path) -> dict[str, str]:
  """A user's shell after `source .venv/bin/activate`: no cluster variables."""
  env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_VARS}
  env.update({'PATH': f'{VENV_BIN}{os.pathsep}{env.get("PATH", "")}',
              'VIRTUAL_ENV': str(VENV_BIN.parent), 'TMPDIR': str(tmp),
              env_lib.PLATFORMS: 'cpu', **_helpers.quick_compile_env()})
  env.pop('PYTHONHOME', None)
  return env


def run_block(block: str, tmp: pathlib.Path) -> tuple[int, str]:
  """Runs `block` in a clone-like folder under `tmp`; (status, output)."""
  clone = tmp / 'clone'
  clone.mkdir(exist_ok=True)
  if not (clone / 'bin').exists():
    (clone / 'bin').symlink_to(ROOT / 'bin')
  log = tmp / 'block.log'
  with open(log, 'wb') as out:
    # A file, not a pipe: a process the block left in the background would
    # hold a pipe open after the block's own exit.
    proc = subprocess.Popen(
        ['bash', '-euo', 'pipefail', '-c', script(block, tmp)], cwd=clone,
        env=_env(tmp), stdin=subprocess.DEVNULL, stdout=out,
        stderr=subprocess.STDOUT, start_new_session=True)
  try:
    rc = proc.wait(timeout=BLOCK_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    rc = 124
  finally:
    # Whatever the block left running (its own process group).
    _kill_group(proc.pid)
    proc.wait(timeout=30)
  return rc, log.read_text()


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except ProcessLookupError:
    pass


PAGE_BLOCKS = [(page.relative_to(ROOT), block) for page in PAGES
               for block in blocks(page.read_text())]
README_BLOCKS = [block for _, block in PAGE_BLOCKS]
# Each runnable block once (the quick start is on two pages), named by the
# page that shows it first.
_FIRST = {b: f'{page}:{b.splitlines()[-1][:40]}' for page, b in
          reversed(PAGE_BLOCKS) if reason_not_run(b) is None}
RUNNABLE = [b for b in dict.fromkeys(README_BLOCKS) if b in _FIRST]
_IDS = [_FIRST[b] for b in RUNNABLE]


def test_every_block_is_run_or_has_a_reason():
  assert README_BLOCKS, 'README.md has no shell block'
  assert len(PAGES) > 10, PAGES
  for phrase in MUST_RUN:
    assert any(phrase in b for b in RUNNABLE), (
        f'no runnable block contains {phrase!r}')
  for phrase in NOT_RUN:
    assert any(phrase in b for b in README_BLOCKS), (
        f'NOT_RUN lists {phrase!r}, which no block contains any more')


def test_every_command_block_is_labelled():
  """A block of commands is ```sh (run or listed above), never unlabelled."""
  for page in PAGES:
    for block in re.findall(r'^ *```\n(.*?)^ *```', page.read_text(),
                            re.S | re.M):
      assert not re.search(r'^\s*(python|pip|srun|sbatch|export) ', block,
                           re.M), f'{page}: label this block ```sh:\n{block}'


def test_the_quick_start_is_the_two_commands_ci_runs():
  """README's first block: install + train, install + the test command."""
  quick = README_BLOCKS[0]
  commands = [ln for ln in quick.splitlines() if not ln.startswith('#')]
  assert len(commands) == 2, quick
  assert commands[0].endswith('pip install -e . && python bin/train.py')
  assert 'pip install -e ".[test]" && python -m pytest tests' in commands[1]
  ci = (ROOT / '.ci' / 'run').read_text().splitlines()
  pytest_line = next(ln for ln in ci if ' -m pytest ' in ln)
  assert commands[1].endswith(
      pytest_line.replace('.venv/bin/python', 'python')), (quick, pytest_line)


def test_blocks_use_the_activated_venv_consistently():
  """The quick start activates the venv, so no block names .venv/bin/."""
  for block in README_BLOCKS:
    assert not re.search(r'\.venv/bin/(python|pip)', block), block
  assert 'source .venv/bin/activate' in README_BLOCKS[0], README_BLOCKS[0]


@pytest.mark.parametrize('index', range(len(RUNNABLE)), ids=_IDS)
def test_the_block_runs_as_printed(index, tmp_path):
  block = RUNNABLE[index]
  rc, out = run_block(block, tmp_path)
  assert rc == 0, (f'block exits {rc}:\n{block}\nas run:\n'
                   f'{script(block, tmp_path)}\noutput:\n{out[-4000:]}')
  assert 'Traceback' not in out, out[-4000:]
