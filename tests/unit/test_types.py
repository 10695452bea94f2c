"""multihost and recovery type-check: mypy, as pyproject.toml's [tool.mypy] says, reports no error."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_mypy_finds_no_errors():
  pytest.importorskip('mypy', reason='pip install -e ".[test]" brings mypy')
  # mypy's incremental cache, in the checkout (git ignores it): cold, the
  # check takes about 12 s of CPU; with the cache of an earlier run, 0.2 s.
  cache = ROOT / '.mypy_cache'
  done = subprocess.run(
      [sys.executable, '-m', 'mypy', '--config-file', 'pyproject.toml',
       '--cache-dir', str(cache), 'multihost', 'recovery'],
      capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
  output = done.stdout + done.stderr
  # 1: errors (listed); 2: mypy itself failed (its message).
  assert done.returncode == 0, output[-6000:]
