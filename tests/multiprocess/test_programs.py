"""The test programs (tests/programs/) are modules: each imports, runs nothing on import, and has a documented main()."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from _helpers import PROGRAMS
from _helpers import program
import pytest

# (Modules whose names start with '_' are what programs share, not programs.)
_NAMES = sorted(p.stem for p in PROGRAMS.glob('*.py')
                if not p.stem.startswith('_'))


def test_there_are_programs():
  assert len(_NAMES) >= 20, _NAMES


@pytest.mark.parametrize('name', _NAMES)
def test_a_program_imports_without_running_and_documents_itself(name):
  spec = importlib.util.spec_from_file_location(f'_program_{name}',
                                                PROGRAMS / f'{name}.py')
  assert spec is not None and spec.loader is not None, name
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert callable(getattr(module, 'main', None)), f'{name} has no main()'
  assert module.__doc__ and module.__doc__.strip(), f'{name} has no docstring'


def test_a_program_runs_by_path_from_any_directory(tmp_path):
  # As the tests start them: by path, from another working directory.
  out = subprocess.run(program('hello_exit'), cwd=tmp_path, timeout=60,
                       capture_output=True, text=True,
                       env={'JAX_PROCESS_ID': '1', 'PATH': '/usr/bin:/bin'})
  assert (out.returncode, out.stdout) == (5, 'hello from 1\n'), out
  with pytest.raises(FileNotFoundError, match='no test program'):
    program('no_such_program')
  assert sys.executable == program('hello_exit')[0]
