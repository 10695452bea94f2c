"""The packages under multihost/_src, recovery/_src and multihost/launch/_src form layers: imports run one way.

Read from the packages themselves: each `_src/__init__.py` names its
packages top to bottom (LAYERS); every package found on disk must be listed,
and a module may import only modules of its own package or of the packages
listed after it. Modules must not import each other in a cycle.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Each one's _src/__init__.py names its packages (LAYERS).
PACKAGES = ('multihost', 'recovery', 'multihost.launch')


def _layers(top: str) -> tuple[str, ...]:
  return importlib.import_module(f'{top}._src').LAYERS


def _folder(top: str) -> pathlib.Path:
  return ROOT.joinpath(*top.split('.'))


def _modules(top: str) -> dict[str, pathlib.Path]:
  """Every module of `top`, by dotted name."""
  base = _folder(top)
  out = {}
  for path in sorted(base.rglob('*.py')):
    parts = path.relative_to(ROOT).with_suffix('').parts
    if parts[-1] == '__init__':
      parts = parts[:-1]
    out['.'.join(parts)] = path
  return out


def _typing_only(tree: ast.AST) -> set[int]:
  """The ids of nodes under `if TYPE_CHECKING:` (imports for annotations only)."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and 'TYPE_CHECKING' in ast.unparse(node.test):
      out.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
  return out


def _imports(path: pathlib.Path, name: str) -> set[str]:
  """The dotted modules `path` imports at run time (function-local ones included; not those for annotations only)."""
  out = set()
  package = name if path.name == '__init__.py' else name.rsplit('.', 1)[0]
  tree = ast.parse(path.read_text())
  skip = _typing_only(tree)
  for node in ast.walk(tree):
    if id(node) in skip:
      continue
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      module = node.module or ''
      if node.level:
        module = '.'.join(package.split('.')[:len(package.split('.')) -
                                            node.level + 1] +
                          ([module] if module else []))
      out.add(module)
      out.update(f'{module}.{a.name}' for a in node.names)
  return out


def _part(top: str, dotted: str) -> str | None:
  """The _src package `dotted` belongs to, or None outside _src."""
  prefix = top + '._src.'
  if dotted.startswith(prefix):
    return dotted[len(prefix):].split('.')[0]
  return None


@pytest.mark.parametrize('top', PACKAGES)
def test_every_package_has_a_layer(top):
  found = sorted(p.name for p in (_folder(top) / '_src').iterdir()
                 if (p / '__init__.py').exists())
  assert sorted(_layers(top)) == found


@pytest.mark.parametrize('top', PACKAGES)
def test_imports_run_one_way(top):
  rank = {name: i for i, name in enumerate(_layers(top))}
  upward = []
  for name, path in _modules(top).items():
    mine = _part(top, name)
    if mine is None:
      continue
    for dep in _imports(path, name):
      theirs = _part(top, dep)
      if theirs is not None and rank[theirs] < rank[mine]:
        upward.append(f'{name} imports {dep}')
  assert sorted(upward) == []


@pytest.mark.parametrize('top', PACKAGES)
def test_no_import_cycle(top):
  modules = _modules(top)
  graph = {name: {d for d in _imports(path, name) if d in modules} - {name}
           for name, path in modules.items()}
  done: set[str] = set()
  cycles = []

  def visit(name, stack):
    if name in stack:
      cycles.append(stack[stack.index(name):] + [name])
      return
    if name in done:
      return
    for dep in sorted(graph.get(name, ())):
      # A package's __init__ importing its own modules is not a cycle.
      if not dep.startswith(name + '.'):
        visit(dep, stack + [name])
    done.add(name)

  for name in sorted(graph):
    visit(name, [])
  assert cycles == []


def test_multihost_never_imports_recovery_or_orbax():
  offenders = [f'{name} imports {dep}'
               for name, path in _modules('multihost').items()
               for dep in _imports(path, name)
               if dep.split('.')[0] in ('recovery', 'orbax')]
  assert offenders == []


def test_recovery_uses_multihost_public_names_only():
  offenders = [f'{name} imports {dep}'
               for name, path in _modules('recovery').items()
               for dep in _imports(path, name)
               if dep.startswith('multihost._src')
               or dep.startswith('orbax.checkpoint._src')]
  assert offenders == []


def test_leaves_imports_no_other_multihost_module():
  """The pure pytree/bytes module must not pull in the watchdog (or anything)."""
  path = ROOT / 'multihost/_src/runtime/leaves.py'
  deps = {d for d in _imports(path, 'multihost._src.runtime.leaves')
          if d.startswith('multihost')}
  assert deps == set()


def _lowlevel_names(path: pathlib.Path) -> set[str]:
  """The names of `multihost.lowlevel` that `path` uses (imported from it, or read as its attributes)."""
  tree = ast.parse(path.read_text())
  aliases, used = set(), set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module == 'multihost.lowlevel':
      used.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module == 'multihost':
      aliases.update(a.asname or a.name for a in node.names
                     if a.name == 'lowlevel')
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name == 'multihost.lowlevel':
          aliases.add(a.asname or 'multihost.lowlevel')
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and ast.unparse(node.value) in aliases:
      used.add(node.attr)
  return used


def test_recovery_takes_from_lowlevel_only_what_its_docstring_allows():
  lowlevel = importlib.import_module('multihost.lowlevel')
  assert 'FOR_RECOVERY' in lowlevel.__doc__
  assert all(hasattr(lowlevel, name) for name in lowlevel.FOR_RECOVERY)
  offenders = sorted(
      f'{name} uses multihost.lowlevel.{used}'
      for name, path in _modules('recovery').items()
      for used in _lowlevel_names(path) - set(lowlevel.FOR_RECOVERY))
  assert offenders == [], (
      'recovery takes these from multihost.lowlevel, whose docstring allows '
      f'only {lowlevel.FOR_RECOVERY}: use multihost\'s public API or '
      f'recovery\'s own helpers:\n  ' + '\n  '.join(offenders))


# docs/layout.md's tables: a heading per tree, a row per package whose last
# cell names its modules in backticks.
_LAYOUT_TREES = {'multihost/_src': 'multihost/_src',
                 'multihost/launch/_src': 'multihost/launch/_src',
                 'recovery/_src': 'recovery/_src', 'bin': '.'}


def _layout_tables() -> dict[str, set[str]]:
  """{'multihost/_src/clusters': {'chain', ...}, ...}: each package docs/layout.md names, and the modules it names there."""
  out: dict[str, set[str]] = {}
  tree = None
  for line in (ROOT / 'docs' / 'layout.md').read_text().splitlines():
    if line.startswith('## '):
      tree = _LAYOUT_TREES.get(line[3:].strip('` '))
    elif tree and line.startswith('| `'):
      cells = [c.strip() for c in line.strip('|').split('|')]
      package = cells[0].strip('`').rstrip('/')
      where = package if tree == '.' else f'{tree}/{package}'
      out[where] = set(re.findall(r'`([A-Za-z_0-9]+)`', cells[-1]))
  return out


def _on_disk() -> dict[str, set[str]]:
  """The same, from the files: every package of the three trees and bin/, and its modules."""
  out = {}
  for tree, _ in _LAYOUT_TREES.items():
    folder = ROOT / tree
    packages = ([folder] if tree == 'bin' else
                [p.parent for p in folder.rglob('__init__.py') if p.parent
                 != folder])
    for package in packages:
      out[str(package.relative_to(ROOT))] = {
          p.stem for p in package.glob('*.py') if p.name != '__init__.py'}
  return out


def test_layout_md_names_every_package_and_module_and_no_other():
  documented, actual = _layout_tables(), _on_disk()
  wrong = []
  for package in sorted(set(documented) | set(actual)):
    missing = actual.get(package, set()) - documented.get(package, set())
    stale = documented.get(package, set()) - actual.get(package, set())
    if package not in documented:
      wrong.append(f'{package}: no row')
    elif package not in actual:
      wrong.append(f'{package}: a row, but no such package')
    if missing:
      wrong.append(f'{package}: modules not named: {sorted(missing)}')
    if stale:
      wrong.append(f'{package}: named, but no such module: {sorted(stale)}')
  assert not wrong, ('docs/layout.md does not describe the code as it is; '
                     'update its tables:\n  ' + '\n  '.join(wrong))
