"""Shared scaffolding of the multi-process tests: programs, pids, bounded waits.

The programs that tests start as separate processes live in tests/programs/,
one module each; `program(name, *args)` is the command line that runs one by
path (so the child needs no PYTHONPATH or working directory of its own).
"""

from __future__ import annotations

import atexit
from collections.abc import Iterable
from collections.abc import Iterator
import contextlib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROGRAMS = pathlib.Path(__file__).resolve().parent / 'programs'


@contextlib.contextmanager
def held_port() -> Iterator[int]:
  """A free port for a coordination service the test starts, held from other runs' port-0 binds until the block ends (`multihost.launch.hold_free_port`, as the launcher holds its own)."""
  from multihost import launch  # pylint: disable=g-import-not-at-top
  hold = launch.hold_free_port()
  try:
    yield hold.getsockname()[1]
  finally:
    hold.close()


def program(name: str, *args: object) -> list[str]:
  """The command line that runs tests/programs/`name`.py with `args`."""
  path = PROGRAMS / f'{name}.py'
  if not path.is_file():
    raise FileNotFoundError(f'no test program {path}')
  return [sys.executable, str(path), *(str(a) for a in args)]


def mode_parts(outputs: Iterable[str], mode: str) -> list[str]:
  """Each output's part after its one 'MODE <mode>' line (a program that runs several modes in turn)."""
  parts = []
  for out in outputs:
    mine = [p for p in out.split('MODE ')[1:] if p.startswith(mode + '\n')]
    assert len(mine) == 1, (mode, out[-3000:])
    parts.append(mine[0])
  return parts


def alive(pid: int) -> bool:
  """Whether `pid` runs (a zombie, or no such process, counts as gone)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] not in ('Z', 'X')
  except OSError:
    return False


def wait_gone(pid: int, timeout: float) -> bool:
  """Whether `pid` is gone within `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while alive(pid):
    if time.monotonic() > deadline:
      return False
    time.sleep(0.05)
  return True


def kill_alive(pids: Iterable[int]) -> None:
  """SIGKILLs those of `pids` (ours) that still run."""
  for pid in pids:
    if alive(pid):
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass


def stop(proc: subprocess.Popen, timeout: float = 30) -> int:
  """SIGKILLs `proc` (ours) if it still runs; reaps it; its return code."""
  if proc.poll() is None:
    proc.kill()
  return proc.wait(timeout=timeout)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
  """Waits up to `timeout` s in all for `procs`; kills the rest; their codes."""
  deadline = time.monotonic() + timeout
  try:
    for p in procs:
      p.wait(timeout=max(deadline - time.monotonic(), 0.1))
  except subprocess.TimeoutExpired:
    pass
  finally:
    for p in procs:
      stop(p)
  return [p.returncode for p in procs]


def read_pids(stream, marker: str, count: int, timeout: float) -> list[int]:
  """The pids printed as `marker PID` lines on `stream`, until `count` came.

  Stops early at end of stream or after `timeout` seconds (checked between
  lines; the caller bounds the writer).
  """
  pids: list[int] = []
  deadline = time.monotonic() + timeout
  while len(pids) < count and time.monotonic() < deadline:
    line = stream.readline()
    if not line:
      break
    if marker in line:
      pids.append(int(line.split(marker, 1)[1].split()[0]))
  return pids


def wait_text(path: pathlib.Path, text: str, timeout: float) -> str:
  """Returns `path`'s text once it holds `text`; AssertionError after `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    out = path.read_text(errors='replace')
    if text in out:
      return out
    time.sleep(0.05)
  raise AssertionError(f'{text!r} not in {path} within {timeout} s:\n'
                       f'{path.read_text(errors="replace")[-3000:]}')


def clean_env(**extra: str) -> dict[str, str]:
  """os.environ without any launcher's or scheduler's variables, plus `extra`."""
  drop = ('JAX_', 'MULTIHOST_', 'SLURM_', 'OMPI_')
  env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
  env.update(extra)
  return env


_COMPILE_CACHE: list[str] = []


def quick_compile_env() -> dict[str, str]:
  """Variables that make the JAX processes a test starts compile less.

  The same programs (bin/train.py, the workloads) start again and again in
  one pytest process; JAX's persistent cache lets each later start load the
  executables the first one compiled instead of compiling them again. The
  folder is this pytest process's own (two pytest workers never write one
  file at once; within a multi-controller run JAX writes from process 0
  only) and is removed when it exits. XLA's backend optimizations are off:
  the tests' programs are tiny, most of their CPU is compiling them, and
  what the tests compare (runs of one program, with the same flags) does
  not depend on how well the code is optimized.
  """
  if not _COMPILE_CACHE:
    folder = tempfile.mkdtemp(prefix='multihost-tests-jax-cache-')
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    _COMPILE_CACHE.append(folder)
  flags = os.environ.get('XLA_FLAGS', '')
  return {'JAX_COMPILATION_CACHE_DIR': _COMPILE_CACHE[0],
          # Every executable, however small or quick to compile.
          'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
          'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0',
          'XLA_FLAGS': f'{flags} --xla_backend_optimization_level=0 '
                       '--xla_llvm_disable_expensive_passes=true'.strip()}


def readme_swap_example() -> str:
  """The README's drop-in swap example (its one ```python block holding the swap)."""
  phrase = '# Before: from jax.experimental.multihost_utils import ('
  blocks = [b for b in re.findall(r'^```python\n(.*?)^```',
                                  (ROOT / 'README.md').read_text(), re.S | re.M)
            if phrase in b]
  assert len(blocks) == 1, blocks
  return blocks[0]


def run_each(argv: list[str], envs: list[dict[str, str]], *, cwd,
             timeout: float) -> tuple[list[int], list[str]]:
  """Runs `argv` once per environment, all at once; their exit codes and outputs (stdout and stderr)."""
  procs = []
  try:
    for env in envs:
      procs.append(subprocess.Popen(
          argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    codes = wait_all(procs, timeout=10)
  return codes, outs


# A clean 2-controller run prints at most this many lines (the launcher's
# quiet run of bin/train.py prints 7, README's example 2), under any engine.
QUIET_RUN_LINES = 12


def gloo_lines(text: str) -> list[str]:
  """The lines of `text` with any piece of gloo's connection line ("[Gloo] Rank N is connected to M peer ranks. ...")."""
  return [ln for ln in text.splitlines()
          if '[Gloo]' in ln or 'peer ranks' in ln]
