"""Liveness is used through its interface: no module outside multihost/_src/liveness reads or writes a Watchdog's state.

Nor do the other liveness modules (the watched calls of `blocking`, the exit
handshake): only liveness/watchdog.py touches the Watchdog's attributes.

Read from the source as text, so each finding names the file and line:
- the Watchdog keeps its state private (every attribute its constructor
  sets starts with `_`), so its public surface is its methods;
- outside watchdog.py, `watchdog.X`, `wd.X` and `dog.X` (the names
  the code gives a runtime's watchdog, or the watchdog module) name only a
  public method of `Watchdog` or a public name of the module
  (`snapshot()` is how other packages read what it knows);
- outside watchdog.py, no `._x` names one of the Watchdog's
  private attributes on another object (an alias of a watchdog); names
  that other classes also set on themselves (`_thread`, `_cond`) are left
  to the rule above.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIVENESS = ROOT / 'multihost' / '_src' / 'liveness'
WATCHDOG = LIVENESS / 'watchdog.py'
SCANNED = ('multihost', 'recovery', 'bin', 'bench', 'tests')
# The names the code gives a runtime's watchdog (or the watchdog module).
_HOLDER = re.compile(r'\b(?:watchdog|wd|dog)\.(\w+)')


def _watchdog_class(tree: ast.Module) -> ast.ClassDef:
  for node in tree.body:
    if isinstance(node, ast.ClassDef) and node.name == 'Watchdog':
      return node
  raise AssertionError(f'{WATCHDOG.relative_to(ROOT)} defines no Watchdog')


def _state(cls: ast.ClassDef) -> set[str]:
  """The attributes the Watchdog's methods set on `self`."""
  out = set()
  for node in ast.walk(cls):
    targets = []
    if isinstance(node, ast.Assign):
      targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
      targets = [node.target]
    for t in targets:
      for sub in ast.walk(t):
        if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
            and sub.value.id == 'self'):
          out.add(sub.attr)
  return out


def _set_elsewhere(files: list[pathlib.Path]) -> set[str]:
  """The attributes that classes in `files` (other than the Watchdog) set on `self`."""
  out = set()
  for path in files:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.ClassDef) and not (
          path == WATCHDOG and node.name == 'Watchdog'):
        out |= _state(node)
  return out


def _allowed(tree: ast.Module, cls: ast.ClassDef) -> set[str]:
  """Public methods of Watchdog, and the watchdog module's public names."""
  names = {n.name for n in cls.body
           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
           and not n.name.startswith('_')}
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, ast.Assign):
      names.update(t.id for t in node.targets if isinstance(t, ast.Name))
  return {n for n in names if not n.startswith('_')}


def _outside_watchdog() -> list[pathlib.Path]:
  this = pathlib.Path(__file__).resolve()
  return sorted(p for top in SCANNED for p in (ROOT / top).rglob('*.py')
                if p != WATCHDOG and p.resolve() != this
                and '.venv' not in p.parts)


def violations() -> list[str]:
  """Every place outside liveness/watchdog.py that touches a Watchdog's state, as 'path:line: text'."""
  tree = ast.parse(WATCHDOG.read_text())
  cls = _watchdog_class(tree)
  state = _state(cls)
  allowed = _allowed(tree, cls)
  files = _outside_watchdog()
  own = sorted(state - _set_elsewhere(files + [WATCHDOG]))
  private = re.compile(
      r'(?<!\bself)\.(' + '|'.join(map(re.escape, own)) + r')\b')
  out = [f'{WATCHDOG.relative_to(ROOT)}: Watchdog.{name} is public state '
         '(make it private and give it a method, or put it in its Snapshot)'
         for name in sorted(state) if not name.startswith('_')]
  for path in files:
    for i, line in enumerate(path.read_text().splitlines(), 1):
      where = f'{path.relative_to(ROOT)}:{i}: {line.strip()}'
      for m in _HOLDER.finditer(line):
        if m.group(1) not in allowed and m.group(1) != 'py':  # (watchdog.py)
          out.append(f'{where}  (reads or writes .{m.group(1)})')
      for m in private.finditer(line):
        out.append(f'{where}  (touches the private .{m.group(1)})')
  return out


def test_no_module_but_the_watchdogs_own_touches_its_state():
  found = violations()
  assert not found, (
      'Outside multihost/_src/liveness/watchdog.py, use the Watchdog\'s '
      'methods and its snapshot(), not its attributes:\n' + '\n'.join(found))


def test_the_scan_sees_the_watchdogs_state_and_methods():
  """The rules above hold something: the class has private state, a snapshot and methods to call."""
  tree = ast.parse(WATCHDOG.read_text())
  cls = _watchdog_class(tree)
  state = _state(cls)
  allowed = _allowed(tree, cls)
  assert {'_failed', '_exited', '_running', '_stopping', '_calls'} <= state
  assert {'snapshot', 'call', 'check', 'watching', 'finish'} <= allowed
  assert not state & allowed
