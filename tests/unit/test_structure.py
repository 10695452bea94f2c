"""The code stays plain: no rebound globals, every environment variable named in multihost/env.py.

Read from the source as text (ast), so each rule names the file and line
that breaks it:
- no `global` statement in multihost/, recovery/ or bin/: state that
  changes after import lives on an object (e.g. `runtime.PROCESS`);
- no environment variable's name spelled outside multihost/env.py in
  multihost/, recovery/, bin/ or bench/: a string that is a variable's
  name by its prefix (JAX_, MULTIHOST_, ...), or any string read from or
  written to `os.environ`/`os.getenv` directly. Docstrings and messages
  may mention a name in prose; code refers to the constant.

No rule here counts lines or modules: a module lands in the package whose
job it is, whatever its length (docs/layout.md, "Where code goes").
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCANNED = ('multihost', 'recovery', 'bin', 'bench')
LIBRARY = ('multihost', 'recovery', 'bin')
ENV_MODULE = ROOT / 'multihost' / 'env.py'
# A string that is exactly an environment variable's name, by its prefix.
_ENV_NAME = re.compile(
    r'(JAX|XLA|TF|MULTIHOST|RECOVERY|SLURM|OMPI|PMI|TPU|KUBERNETES|PYTEST|'
    r'SCALE_DRILL)_[A-Za-z0-9_]+|PYTHON[A-Z]+')
_ENVIRON_METHODS = ('get', 'pop', 'setdefault', '__getitem__', '__contains__')


def _files(*tops: str) -> list[pathlib.Path]:
  return sorted(p for top in tops for p in (ROOT / top).rglob('*.py'))


def _where(path: pathlib.Path, line: int) -> str:
  return f'{path.relative_to(ROOT)}:{line}'


def global_statements(tops=LIBRARY) -> list[str]:
  """Every `global` statement (a module name rebound after import)."""
  out = []
  for path in _files(*tops):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Global):
        out.append(f'{_where(path, node.lineno)} global '
                   f'{", ".join(node.names)}')
  return out


def _docstrings(tree: ast.AST) -> set[int]:
  """The ids of the string constants that are docstrings (or bare string statements)."""
  return {id(node.value) for node in ast.walk(tree)
          if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
          and isinstance(node.value.value, str)}


def _is_environ(node: ast.AST) -> bool:
  """`os.environ` (or any `<x>.environ`)."""
  return isinstance(node, ast.Attribute) and node.attr == 'environ'


def _environ_keys(tree: ast.AST) -> list[ast.Constant]:
  """The string constants used as keys of os.environ or os.getenv/putenv."""
  keys = []
  for node in ast.walk(tree):
    key = None
    if isinstance(node, ast.Subscript) and _is_environ(node.value):
      key = node.slice
    elif isinstance(node, ast.Call) and node.args:
      f = node.func
      if isinstance(f, ast.Attribute) and (
          (f.attr in _ENVIRON_METHODS and _is_environ(f.value))
          or f.attr in ('getenv', 'putenv', 'unsetenv')):
        key = node.args[0]
    elif (isinstance(node, ast.Compare) and len(node.ops) == 1
          and isinstance(node.ops[0], (ast.In, ast.NotIn))
          and _is_environ(node.comparators[0])):
      key = node.left
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
      keys.append(key)
  return keys


def env_names(tops=SCANNED) -> list[str]:
  """Environment variable names spelled outside multihost/env.py."""
  out = []
  for path in _files(*tops):
    if path == ENV_MODULE:
      continue
    tree = ast.parse(path.read_text())
    prose = _docstrings(tree)
    named = {id(k): k for k in _environ_keys(tree)}
    for node in ast.walk(tree):
      if (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in prose and _ENV_NAME.fullmatch(node.value)):
        named[id(node)] = node
    out += [f'{_where(path, k.lineno)} {k.value!r}' for k in named.values()]
  return sorted(out)


def _none(found: list[str], fix: str) -> None:
  assert not found, fix + '\n  ' + '\n  '.join(found)


def test_no_module_global_is_rebound():
  _none(global_statements(), 'A `global` statement rebinds a module name '
        'after import: hold the state on an object its users can see (as '
        'runtime.PROCESS does).')


def test_every_environment_variable_is_named_in_env_py():
  _none(env_names(), 'Environment variable names spelled outside '
        'multihost/env.py: add a constant there and use it.')
