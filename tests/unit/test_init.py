"""multihost's public names: every one loads on first use, and importing the package alone imports no JAX."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import multihost

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _typed_names() -> set[str]:
  """The names __init__.py imports under TYPE_CHECKING (what static tools see)."""
  tree = ast.parse((ROOT / 'multihost' / '__init__.py').read_text())
  names = set()
  for node in tree.body:
    if isinstance(node, ast.If):
      for sub in ast.walk(node):
        if isinstance(sub, ast.ImportFrom):
          names.update(a.asname or a.name for a in sub.names)
  return names


def test_static_and_lazy_names_agree_and_all_load():
  assert _typed_names() == set(multihost.__all__)
  for name in multihost.__all__:
    value = getattr(multihost, name)
    if name in multihost._SUBMODULES:
      assert value.__name__ == f'multihost.{name}'
    else:
      module = sys.modules[f'multihost.{multihost._WHERE[name]}']
      assert value is getattr(module, name), name
  assert set(multihost.__all__) <= set(dir(multihost))


def test_an_unknown_name_is_an_attribute_error():
  try:
    multihost.broadcast_one_to_none  # noqa: B018
  except AttributeError as e:
    assert "no attribute 'broadcast_one_to_none'" in str(e)
  else:
    raise AssertionError('an unknown name did not raise AttributeError')


def test_the_launcher_and_env_import_no_jax():
  code = ('import sys, multihost, multihost.env, multihost.launch, '
          'multihost.netns; print(sorted(m for m in sys.modules '
          "if m == 'jax' or m.startswith('jax.')))")
  out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, timeout=60, check=True).stdout
  assert out.strip() == '[]', out
