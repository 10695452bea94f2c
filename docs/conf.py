"""Sphinx configuration of the docs site (issue 39): MyST Markdown guides and
an API reference from the docstrings (autodoc + napoleon, Google style).

Build: `python -m sphinx -W --keep-going -b html docs docs/_build/html`
(tests/unit/test_docs.py builds it so in CI, warnings as errors). No
network at build time (no intersphinx); the theme is furo, with a few
lines of CSS (docs/_static/tables.css) so that the tables fit 1280 px.
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's packages, installed or not

project = 'multihost'
author = 'the multihost authors'
copyright = 'the multihost authors'  # noqa: A001 (Sphinx's name)
release = version = '0.1.0'

extensions = [
    'myst_parser',
    'sphinx.ext.autodoc',
    'sphinx.ext.napoleon',
]
source_suffix = {'.md': 'markdown'}
root_doc = 'index'
exclude_patterns = ['_build', '**/.*']

# MyST: `#`-anchors for headings up to ###, so guides link to sections
# (`[text](failures.md#the-self-healing-run)`).
myst_heading_anchors = 3
myst_enable_extensions = ['colon_fence']

# autodoc: signatures as written, in source order; Google-style docstrings.
autodoc_member_order = 'bysource'
autodoc_typehints = 'signature'
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# `name` in a docstring is code, as in the guides' Markdown.
default_role = 'code'

# furo: a theme of the field (pip's, attrs', ...), in the test extra.
html_theme = 'furo'
html_title = 'multihost and recovery'
html_static_path = ['_static']
html_css_files = ['tables.css']


# The docstrings are written for `help()` and editors, in Markdown's habits
# (`code`, lists right under a sentence, aligned columns). Before napoleon
# reads them, make those habits valid reStructuredText, so that the reference
# builds without warnings and reads as the source does.
_CODE = re.compile(r'(?<![`\\])`([^`\n]+?)`(?!`)')
_ITEM = re.compile(r'^(\s*)([*-]|\d+\.) \S')
_COLUMNS = re.compile(r'\S {2,}\S')


def _literal(match: re.Match[str]) -> str:
  return f'``{match.group(1).strip()}``'


def _code(line: str) -> str:
  return _join(_CODE.sub(_literal, line))


def _join(line: str) -> str:
  """`jax.Array`s: an inline literal glued to a word needs an escaped space."""
  out, i = [], 0
  for m in re.finditer(r'``[^`]+``', line):
    before, after = m.start(), m.end()
    out.append(line[i:before])
    if before and line[before - 1].isalnum():
      out.append('\\ ')
    out.append(m.group(0))
    if after < len(line) and line[after].isalnum():
      out.append('\\ ')
    i = after
  out.append(line[i:])
  return ''.join(out)


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def _fix_docstring(app, what, name, obj, options, lines) -> None:
  del app, what, name, obj, options
  fixed: list[str] = []
  in_list = None  # the indentation of the current list's items
  literal_block = None  # the indentation the current literal block is under
  for i, line in enumerate(lines):
    stripped = line.strip()
    if literal_block is not None:
      if stripped and _indent(line) <= literal_block:
        literal_block = None
      else:
        fixed.append(line)
        continue
    item = _ITEM.match(line)
    if in_list is not None and stripped and not item and (
        _indent(line) <= in_list):
      if fixed and fixed[-1].strip():
        fixed.append('')
      in_list = None
    if item and fixed and fixed[-1].strip() and in_list is None:
      fixed.append('')
    if item:
      in_list = _indent(line)
    if not stripped:
      in_list = None
    # A paragraph that ends with ':' before an indented block of aligned
    # columns introduces a table: show it as it is written.
    rest = lines[i + 1:]
    if stripped.endswith(':') and not stripped.endswith('::') and (
        len(rest) > 1 and not rest[0].strip() and rest[1].strip() and
        _indent(rest[1]) > _indent(line) and _COLUMNS.search(rest[1].strip())
        and not re.match(r'^\s*\w+(\s*\(.*\))?:$', line)):
      fixed.append(_code(line) + ':')
      literal_block = _indent(line)
      continue
    fixed.append(_code(line))
  lines[:] = fixed


def setup(app):
  # Before napoleon's own handler (priority 500), on the docstring as written.
  app.connect('autodoc-process-docstring', _fix_docstring, priority=100)
