"""The docs site (docs/, issue 39) builds with Sphinx + MyST, warnings as errors.

`python -m sphinx -W --keep-going -b html docs OUT`, as a reader or CI
builds it: a broken link or reference, a page left out of the table of
contents, a docstring that is not valid reStructuredText, or a public name
missing from the API reference fails here. README.md stays short: what it
is, the quick start, two examples and the way to the guides.
"""

from __future__ import annotations

import ast
import fcntl
import html
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import pytest

import multihost

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / 'docs'
BUILD_TIMEOUT_S = 300
README_MAX_LINES = 200
# Reference pages stay reference: the tables, the method and the commands,
# not a log of runs (issue 64). performance.md leaves room for the section
# beside a training step and for how the costs scale.
PAGE_MAX_LINES = {'docs/performance.md': 330, 'bench/README.md': 200}
# The width a reader's browser gives the site, and how long the browser may
# take to open every page of it.
SITE_WIDTH_PX = 1280
BROWSER_TIMEOUT_S = 180


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


@pytest.fixture(scope='module')
def site(tmp_path_factory) -> pathlib.Path:
  """The site built as CI builds it (warnings as errors); its html folder.

  Built once per test session: pytest-xdist's workers share this session's
  folder, and the first to take the lock builds while the others wait.
  """
  for module in ('sphinx', 'myst_parser', 'furo'):
    pytest.importorskip(module, reason='pip install -e ".[test]" brings it')
  session = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    session = session.parent  # This session's, above each worker's own.
  out = session / 'docs-site'
  out.mkdir(exist_ok=True)
  with open(out / 'lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (out / 'outcome.json').exists():
      proc = subprocess.run(
          [sys.executable, '-m', 'sphinx', '-W', '--keep-going', '-q', '-E',
           '-b', 'html', '-d', str(out / 'doctrees'), str(DOCS),
           str(out / 'html')], cwd=ROOT, stdin=subprocess.DEVNULL,
          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
          check=False)
      (out / 'outcome.json').write_text(json.dumps(
          [proc.returncode, proc.stdout[-4000:], proc.stderr[-8000:]]))
  returncode, stdout, stderr = json.loads((out / 'outcome.json').read_text())
  assert returncode == 0, f'sphinx exited {returncode}:\n{stdout}\n{stderr}'
  assert not stderr.strip(), stderr
  return out / 'html'


def test_the_site_builds_without_warnings(site):
  tmp_path = site.parent
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


# A commit hash: 7 to 40 hex digits with a letter and a digit among them.
_HASH = re.compile(r'\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b')
# A run's date or time of day: 2026-12-05, 05:01 UTC, 04:32-04:47 UTC.
_WHEN = re.compile(r'\b20\d\d-[01]\d-[0-3]\d\b|'
                   r'\b\d{1,2}:\d\d(?::\d\d)?(?:-\d{1,2}:\d\d)? ?UTC\b')


def _guides() -> list[pathlib.Path]:
  pages = [ROOT / 'README.md', ROOT / 'bench' / 'README.md',
           *DOCS.glob('**/*.md')]
  return [p for p in pages if '_build' not in p.parts]


def test_the_guides_carry_no_work_history():
  """No commit hashes, run dates or "earlier today": a reader's page, not a log (what changed when: CHANGELOG.md and git)."""
  found = []
  for page in _guides():
    for number, line in enumerate(page.read_text().splitlines(), 1):
      for pattern in (_HASH, _WHEN,
                      re.compile(r'\b(earlier today|this session)\b', re.I)):
        found += [f'{page.relative_to(ROOT)}:{number}: {m.group(0)!r}'
                  for m in pattern.finditer(line)]
  assert not found, ('a guide holds work history (keep what holds now; '
                     'data of runs goes to bench/data/):\n' + '\n'.join(found))


@pytest.mark.parametrize('page', sorted(PAGE_MAX_LINES))
def test_the_reference_pages_stay_short(page):
  lines = len((ROOT / page).read_text().splitlines())
  assert lines <= PAGE_MAX_LINES[page], (
      f'{page} has {lines} lines, over its {PAGE_MAX_LINES[page]}: keep the '
      'tables and their commands; runs go to bench/data/ as data')


def _chromium() -> str | None:
  """Debian's Chromium (.ci/chromium installs it), or None."""
  for name in ('chromium', 'chromium-browser'):
    if found := shutil.which(name):
      return found
  return None


# Opens every page in a frame SITE_WIDTH_PX wide, one after the other, and
# writes what is wider than its room into <pre id="widths">: the page's
# own width, a table wider than its wrapper (furo scrolls it) or than the
# frame, a block of code that scrolls sideways, an image past the edge.
_MEASURE = """<!doctype html><html><body>
<iframe id="page" style="width:%dpx;height:900px;border:0"></iframe>
<pre id="widths"></pre>
<script>
const pages = %s, found = {};
let i = 0;
const frame = document.getElementById('page');
frame.onload = function () {
  const doc = frame.contentDocument, win = frame.contentWindow, wide = [];
  const edge = win.innerWidth;
  if (doc.documentElement.scrollWidth > edge)
    wide.push('the page is ' + doc.documentElement.scrollWidth + ' px wide');
  doc.querySelectorAll('table, pre, img').forEach(function (e) {
    const box = e.tagName === 'TABLE' &&
        e.parentElement.classList.contains('table-wrapper') ?
        e.parentElement : e;
    const right = Math.round(e.getBoundingClientRect().right);
    if (box.scrollWidth > box.clientWidth + 1 || right > edge)
      wide.push(e.tagName.toLowerCase() + ' ' + box.scrollWidth +
                ' px in ' + box.clientWidth + ', right edge at ' + right +
                ': ' + (e.innerText || e.getAttribute('src') || '')
                    .slice(0, 60).replace(/\\s+/g, ' '));
  });
  found[pages[i]] = wide;
  i += 1;
  if (i < pages.length) frame.src = pages[i];
  else document.getElementById('widths').textContent = JSON.stringify(found);
};
frame.src = pages[0];
</script></body></html>"""


def test_every_page_fits_a_1280_px_window(site, tmp_path):
  """Opened in a real browser 1280 px wide, no page scrolls sideways: its tables, code and pictures fit."""
  chromium = _chromium()
  if chromium is None:
    pytest.skip('no Chromium on PATH (Debian: apt-get install chromium; CI: '
                '.ci/chromium): the site\'s width is checked in a browser')
  pages = sorted(str(p.relative_to(site)) for p in site.glob('**/*.html')
                 if not p.name.startswith('_'))
  driver = site / '_widths.html'
  driver.write_text(_MEASURE % (SITE_WIDTH_PX, json.dumps(pages)))
  browser = subprocess.Popen(
      [chromium, '--headless', '--no-sandbox', '--disable-gpu',
       '--disable-quic', '--no-first-run', '--disable-background-networking',
       '--disable-component-update', '--disable-sync',
       f'--user-data-dir={tmp_path / "profile"}',
       '--allow-file-access-from-files', '--hide-scrollbars',
       f'--window-size={SITE_WIDTH_PX + 100},1000',
       '--virtual-time-budget=120000',
       '--run-all-compositor-stages-before-draw', '--dump-dom',
       driver.as_uri()], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    dom, errors = browser.communicate(timeout=BROWSER_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    dom, errors = '', f'no answer in {BROWSER_TIMEOUT_S} s'
  finally:
    try:  # The browser's helpers too: its session is its own.
      os.killpg(browser.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    browser.wait()
  found = re.search(r'<pre id="widths">(.*?)</pre>', dom, re.S)
  assert found and found.group(1), (
      f'{chromium} measured no page (exit status {browser.returncode}): '
      f'{errors[-2000:]}')
  widths = json.loads(html.unescape(found.group(1)))
  assert sorted(widths) == pages
  wide = {page: items for page, items in widths.items() if items}
  assert not wide, (f'wider than a {SITE_WIDTH_PX} px window:\n' +
                    '\n'.join(f'{page}: {item}' for page, items in
                               sorted(wide.items()) for item in items))
