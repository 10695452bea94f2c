"""The code is as pyproject.toml's [tool.ruff] says (ruff comes with the test extra)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
  beside = pathlib.Path(sys.executable).with_name('ruff')
  if beside.exists():
    return [str(beside)]
  found = shutil.which('ruff')
  if found is None:
    pytest.skip('ruff is not installed: pip install -e ".[test]" brings it')
  return [found]


def test_ruff_finds_nothing():
  done = subprocess.run([*_ruff(), 'check', '--no-cache', str(ROOT)],
                        capture_output=True, text=True, timeout=120,
                        check=False, cwd=ROOT)
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
