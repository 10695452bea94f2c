"""Pure report merging: N processes' pytest reports of one test phase -> the one report the parent shows.

Nothing here starts a process or reads a file: the inputs are the workers'
reports (deserialized by pytest's own hooks) and the launcher's
`LaunchResult`, so each rule is testable on hand-made reports.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Any
from typing import Literal

import pytest

from multihost.testing import _marker

OUTPUT_TAIL_LINES = 60
# A test's phases, and their outcomes, as pytest names them.
When = Literal['setup', 'call', 'teardown']
Outcome = Literal['passed', 'failed', 'skipped']


def make_report(item: pytest.Item, when: When, outcome: Outcome,
                longrepr: Any, *,
                sections=(), duration: float = 0.0,
                wasxfail: str | None = None) -> pytest.TestReport:
  """A `pytest.TestReport` of `item`'s phase `when`, as pytest's runner would make it."""
  report = pytest.TestReport(
      item.nodeid, item.location, {k: 1 for k in item.keywords}, outcome,
      longrepr, when, sections=list(sections), duration=duration,
      user_properties=list(item.user_properties))
  if wasxfail is not None:  # (what pytest's runner sets only for an xfail)
    report.wasxfail = wasxfail
  return report


class ProcessesRepr:
  """A failure's `longrepr` that shows each failing process's own pytest longrepr, `[pN]`-prefixed.

  `reprcrash` (the one-line summary, `-rf`, `--tb=line`, JUnit XML) is the
  first failing process's.
  """

  def __init__(self, header: str,
               failures: collections.abc.Sequence[tuple[int, Any]]):
    self._header = header
    self._failures = [(i, str(longrepr)) for i, longrepr in failures]
    self.reprcrash = None
    for i, longrepr in failures:
      crash = getattr(longrepr, 'reprcrash', None)
      if crash is not None:
        try:
          self.reprcrash = dataclasses.replace(
              crash, message=f'[p{i}] {crash.message}')
        except TypeError:  # Not a dataclass: keep it as it is.
          self.reprcrash = crash
        break

  def _lines(self) -> list[str]:
    lines = [self._header]
    for i, text in self._failures:
      lines += ['', f'{"=" * 20} process {i} {"=" * 20}']
      lines += [f'[p{i}] {line}' for line in text.splitlines()]
    return lines

  def toterminal(self, tw) -> None:
    for line in self._lines():
      tw.line(line, red=line.split('] ', 1)[-1].startswith('E '))

  def __str__(self) -> str:
    return '\n'.join(self._lines())


def _skip_reason(report: pytest.TestReport) -> str:
  longrepr = report.longrepr
  if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3:
    return str(longrepr[2])
  return str(longrepr)


def prefix(index: int, text: str) -> str:
  """`text` with `[p<index>] ` before each line."""
  return '\n'.join(f'[p{index}] {line}' for line in text.splitlines())


def combine(item: pytest.Item, spec: _marker.GroupSpec, when: When,
            records: list[pytest.TestReport]) -> pytest.TestReport:
  """One report from every process's report of the same phase.

  Failed if it failed on any process (a process that passed but was told a
  peer failed does not count twice); skipped if skipped on all; passed if
  passed on all; a skip on only some processes is a failure that says so.
  """
  n = spec.num_processes
  outcomes = ['passed' if getattr(r, _marker.PEER_FAILURE, False)
              else r.outcome for r in records]
  duration = max(r.duration for r in records)
  sections = [(f'{title} [p{i}]', prefix(i, text) + '\n')
              for i, r in enumerate(records) for title, text in r.sections]
  if 'failed' in outcomes:
    failing = [i for i, o in enumerate(outcomes) if o == 'failed']
    return make_report(
        item, when, 'failed', ProcessesRepr(
            f'multihost: {when} failed on process(es) {failing} of {n} '
            f'(devices_per_process={spec.devices_per_process}).',
            [(i, records[i].longrepr) for i in failing]),
        sections=sections, duration=duration)
  if all(o == 'skipped' for o in outcomes):
    first = records[0]
    longrepr = first.longrepr
    if isinstance(longrepr, list):  # (path, lineno, reason), through JSON.
      longrepr = tuple(longrepr)
    return make_report(item, when, 'skipped', longrepr, sections=sections,
                       duration=duration,
                       wasxfail=getattr(first, 'wasxfail', None))
  if all(o == 'passed' for o in outcomes):
    return make_report(item, when, 'passed', None, sections=sections,
                       duration=duration)
  skipped = [i for i, o in enumerate(outcomes) if o == 'skipped']
  passed = [i for i, o in enumerate(outcomes) if o == 'passed']
  reasons = '; '.join(f'p{i}: {_skip_reason(records[i])}' for i in skipped)
  return make_report(
      item, when, 'failed',
      f'multihost: {when} was skipped on process(es) {skipped} ({reasons}) '
      f'but passed on {passed}. Every process must make the same skip '
      'decision; skip before the test runs (a marker) or on every process.',
      sections=sections, duration=duration)


def _scaled(spec: _marker.GroupSpec) -> str:
  """' (the marker's 15 s x 2.5 for the machine's load, ...)' when the timeout was scaled; else ''."""
  if spec.scale == 1.0:
    return ''
  return (f' (the marker\'s {spec.timeout / spec.scale:g} s x '
          f'{spec.scale:.2g}: the machine\'s load, or '
          f'${_marker.TIMEOUT_SCALE_ENV})')


def incomplete(item: pytest.Item, spec: _marker.GroupSpec,
               per_process: list[dict[str, pytest.TestReport]], result: Any,
               *, group_started: bool,
               when: When = 'call') -> pytest.TestReport:
  """A failure report for a test that did not complete on every process.

  Args:
    item: the test.
    spec: its group.
    per_process: per process, its reports of this test by phase.
    result: the group's `multihost.launch.LaunchResult`.
    group_started: whether any test of the group reported anything.
    when: the phase to report.
  """
  from multihost import launch  # Not at import: keep plugin loading cheap.

  n = spec.num_processes
  missing = [i for i in range(n) if per_process[i].get('teardown') is None]
  started = [i for i in range(n) if per_process[i].get('setup') is not None]
  if result.timed_out:
    why = (f'the group of {item.nodeid.split("::")[0]} '
           f'(num_processes={n}, devices_per_process='
           f'{spec.devices_per_process}) hit its timeout of '
           f'{spec.timeout:g} s{_scaled(spec)} and was stopped. Pass a '
           'larger '
           f'@pytest.mark.{_marker.MARKER}(..., timeout=...) if it needs '
           'longer, or look for a process waiting in a collective a peer did '
           'not call')
  elif result.first_failure is not None:
    first = result.first_failure
    why = (f'the workers stopped early: process {first} ended first, '
           f'{launch.describe(result.returncodes[first])}')
  else:
    why = 'the worker processes stopped early'
  lines = [f'multihost: this test did not complete on processes {missing} '
           f'of {n}: {why}.']
  if not group_started:
    lines.append('The workers failed before running any test of the group; '
                 'their output below says why.')
  elif not started:
    lines.append('It never started: an earlier test of the same group '
                 'crashed or hung (see that test\'s report).')
  lines += ['', result.summary]
  sections = []
  if started or not group_started:  # Output only where it explains.
    for i, out in enumerate(result.outputs):
      tail = out.splitlines()[-OUTPUT_TAIL_LINES:]
      sections.append((f'Output of process {i} (last {len(tail)} lines)',
                       '\n'.join(f'[p{i}] {line}' for line in tail)))
  return make_report(item, when, 'failed', '\n'.join(lines),
                     sections=sections)
