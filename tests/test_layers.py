"""multihost's private modules form layers: imports go down only, with no cycle.

The layers are read from the map in multihost/__init__.py's docstring, the
one source of the layer map (README's Layout lists the same modules).
"""

from __future__ import annotations

import ast
import pathlib
import re

import multihost

ROOT = pathlib.Path(__file__).resolve().parent.parent

_LAYER_LINE = re.compile(r'^  (\w[\w ,/-]*): (.+)$')
_CONTINUATION = re.compile(r'^    (\w.*)$')


def _layers() -> list[list[str]]:
  """The layer map of multihost/__init__.py's docstring, top to bottom."""
  layers: list[list[str]] = []
  for line in (multihost.__doc__ or '').splitlines():
    if m := _LAYER_LINE.match(line):
      layers.append(m.group(2).split())
    elif layers and (m := _CONTINUATION.match(line)) and ':' not in line:
      layers[-1].extend(m.group(1).split())
  return layers


_LAYERS = _layers()
_RANK = {name: rank for rank, names in enumerate(_LAYERS) for name in names}


def _imports() -> dict[str, set[str]]:
  """Each multihost module's multihost imports, function-local ones included."""
  graph = {}
  for path in sorted((ROOT / 'multihost').rglob('*.py')):
    rel = path.relative_to(ROOT / 'multihost').with_suffix('')
    name = rel.parts[0]  # a subpackage counts as one module
    deps = graph.setdefault(name, set())
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module:
        parts = node.module.split('.')
        if parts[0] != 'multihost':
          continue
        if len(parts) == 1:
          deps.update(a.name for a in node.names)
        else:
          deps.add(parts[1])
      elif isinstance(node, ast.Import):
        deps.update(a.name.split('.')[1] for a in node.names
                    if a.name.startswith('multihost.'))
    deps.discard(name)
  return graph


def test_the_docstring_map_names_each_module_once():
  names = [n for layer in _LAYERS for n in layer]
  assert len(_LAYERS) > 5 and len(names) == len(set(names))


def test_every_module_has_a_layer():
  assert sorted(set(_imports()) - set(_RANK)) == []
  assert sorted(set(_RANK) - set(_imports())) == []


def test_readme_layout_lists_the_same_modules():
  text = (ROOT / 'README.md').read_text()
  layout = text.split('## Layout', 1)[1].split('```')[1]
  block = layout.split('\nrecovery/', 1)[0]
  listed = set(re.findall(r'(?<![/\w])(_?\w+)\.py\b', block))
  listed |= set(re.findall(r'^  (\w+)/ ', block, re.M))  # Subpackages.
  assert sorted(listed ^ set(_RANK)) == []


def test_imports_go_down_only():
  upward = [(a, b) for a, deps in _imports().items() for b in sorted(deps)
            if b in _RANK and a in _RANK and _RANK[b] < _RANK[a]]
  assert upward == []


def test_no_import_cycle():
  graph = _imports()
  done: set[str] = set()
  cycles = []

  def visit(name, stack):
    if name in stack:
      cycles.append(stack[stack.index(name):] + [name])
      return
    if name in done:
      return
    for dep in sorted(graph.get(name, ())):
      visit(dep, stack + [name])
    done.add(name)

  for name in sorted(graph):
    visit(name, [])
  assert cycles == []


def test_leaves_imports_no_other_multihost_module():
  """The pure pytree/bytes module must not pull in the watchdog (or anything)."""
  assert _imports()['_leaves'] == set()
