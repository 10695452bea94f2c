"""The docs site (docs/, issue 39) builds with Sphinx + MyST, warnings as errors.

`python -m sphinx -W --keep-going -b html docs OUT`, as a reader or CI
builds it: a broken link or reference, a page left out of the table of
contents, a docstring that is not valid reStructuredText, or a public name
missing from the API reference fails here. README.md stays short: what it
is, the quick start, two examples and the way to the guides.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

import multihost

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / 'docs'
BUILD_TIMEOUT_S = 300
README_MAX_LINES = 200


def _reexports(init: pathlib.Path) -> list[str]:
  """The names an `__init__.py` re-exports (`from ... import X as X`)."""
  return [alias.name for node in ast.parse(init.read_text()).body
          if isinstance(node, ast.ImportFrom) for alias in node.names
          if alias.asname == alias.name]


# Module -> its public names (multihost's load lazily: its `_PUBLIC`).
PUBLIC = {
    'multihost': sorted(multihost._WHERE),  # noqa: SLF001
    'multihost.launch': _reexports(ROOT / 'multihost/launch/__init__.py'),
    'multihost.testing': _reexports(ROOT / 'multihost/testing/__init__.py'),
    'recovery': _reexports(ROOT / 'recovery/__init__.py'),
}


def test_the_site_builds_without_warnings(tmp_path):
  pytest.importorskip('sphinx', reason='pip install -e ".[test]" brings it')
  pytest.importorskip('myst_parser', reason='pip install -e ".[test]" '
                      'brings it')
  proc = subprocess.run(
      [sys.executable, '-m', 'sphinx', '-W', '--keep-going', '-q', '-E',
       '-b', 'html', '-d', str(tmp_path / 'doctrees'), str(DOCS),
       str(tmp_path / 'html')], cwd=ROOT, stdin=subprocess.DEVNULL,
      capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
  assert proc.returncode == 0, (
      f'sphinx exited {proc.returncode}:\n{proc.stdout[-4000:]}\n'
      f'{proc.stderr[-8000:]}')
  assert not proc.stderr.strip(), proc.stderr[-8000:]
  for page in ('index', 'getting-started', 'migrating', 'failures',
               'recovery', 'launcher', 'pytest', 'observability',
               'performance', 'trust', 'configuration', 'layout',
               'api/multihost', 'api/recovery'):
    assert (tmp_path / 'html' / f'{page}.html').is_file(), page
  api = (tmp_path / 'html' / 'api' / 'multihost.html').read_text()
  assert 'id="multihost.broadcast_one_to_all"' in api


@pytest.mark.parametrize('module', sorted(PUBLIC))
def test_the_api_reference_documents_every_public_name(module):
  page = (DOCS / 'api' / f'{module}.md').read_text()
  documented = re.findall(
      rf'^\.\. auto\w+:: {re.escape(module)}\.(\w+)$', page, re.M)
  assert sorted(documented) == sorted(PUBLIC[module]), (
      f'docs/api/{module}.md: missing {set(PUBLIC[module]) - set(documented)}'
      f', not public {set(documented) - set(PUBLIC[module])}')


def test_the_readme_is_short_and_leads_to_the_guides():
  readme = (ROOT / 'README.md').read_text()
  assert len(readme.splitlines()) <= README_MAX_LINES
  for link in re.findall(r'\]\((docs/[^)#]+)', readme):
    assert (ROOT / link).exists(), link
  guides = {p.name for p in DOCS.glob('*.md')} - {'index.md'}
  linked = set(re.findall(r'\]\(docs/([^)/#]+\.md)', readme))
  assert guides <= linked, f'README links to no {guides - linked}'


def test_the_guides_carry_no_work_history():
  """No commit hashes or "earlier today": a reader's page, not a log."""
  for page in [ROOT / 'README.md', *DOCS.glob('**/*.md')]:
    text = page.read_text()
    assert not re.search(r'\bcommit [0-9a-f]{7,40}\b', text), page
    assert not re.search(r'\b(earlier today|this session)\b', text, re.I), page
