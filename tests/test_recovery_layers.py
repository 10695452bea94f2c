"""recovery's modules form the layers its docstring lists: imports go down only.

The map in recovery/__init__.py's docstring is the one source: every module
of recovery/ appears in it, one a line, and each imports only modules listed
above it (so there is no cycle, and nothing imports the package itself).
"""

from __future__ import annotations

import ast
import pathlib
import re

import recovery

FOLDER = pathlib.Path(recovery.__file__).resolve().parent


def _layer_map() -> list[str]:
  """Module names in the docstring's map, bottom layer first."""
  doc = ast.get_docstring(ast.parse((FOLDER / '__init__.py').read_text()))
  return re.findall(r'^  (_\w+)\.py ', doc, re.M)


def _imports(path: pathlib.Path) -> set[str]:
  """The recovery modules `path` imports, function-local ones included.

  `from recovery import _x` and `from recovery._x import y` both count as
  `_x`; `import recovery` or `from recovery import Name` as '__init__'.
  """
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      for a in node.names:
        parts = a.name.split('.')
        if parts[0] == 'recovery':
          out.add(parts[1] if len(parts) > 1 else '__init__')
    elif isinstance(node, ast.ImportFrom) and node.module:
      parts = node.module.split('.')
      if parts[0] != 'recovery':
        continue
      if len(parts) > 1:
        out.add(parts[1])
      else:
        out.update(a.name if a.name.startswith('_') else '__init__'
                   for a in node.names)
  return out


def test_every_module_appears_once_in_the_layer_map():
  layers = _layer_map()
  modules = sorted(p.stem for p in FOLDER.glob('_*.py')
                   if p.name != '__init__.py')
  assert len(layers) == len(set(layers)), layers
  assert sorted(layers) == modules


def test_imports_go_down_the_layer_map_only():
  rank = {name: i for i, name in enumerate(_layer_map())}
  upward = []
  for name, i in rank.items():
    for dep in sorted(_imports(FOLDER / f'{name}.py')):
      if dep == name:
        continue
      if dep not in rank or rank[dep] >= i:
        upward.append(f'{name} imports {dep}')
  assert upward == []
