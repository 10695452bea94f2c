"""multihost's private modules form layers: imports go down only, with no cycle."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Top to bottom, as in multihost/__init__.py's docstring. A module may import
# modules of its own layer or below (public modules may use one another).
_LAYERS = [
    ['__init__', 'lowlevel', 'testing', 'launch', 'netns'],
    ['_broadcast', '_gather', '_sync', '_equal', '_digest', '_arrays',
     '_preemption', '_watched', '_initialize', '_stragglers',
     '_live_devices'],
    ['_objects', '_data_plane'],
    ['_control_agree'],
    ['_control_codec'],
    ['_control_rendezvous'],
    ['_where'],
    ['_calls', '_flight'],
    ['_data_tcp', '_data_device'],
    ['_secret'],
    ['_watchdog'],
    ['_diagnostics', '_companion'],
    ['_coordination'],
    ['_process'],
    ['_leaves', '_errors', 'env'],
]
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


def test_every_module_has_a_layer():
  assert sorted(set(_imports()) - set(_RANK)) == []


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
