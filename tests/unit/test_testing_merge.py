"""Unit tests of the pytest plugin's pure report merging (multihost.testing._merge), on hand-made reports.

No process is started: the inputs are what the workers' reports and the
launcher's result would be.
"""

from __future__ import annotations

import dataclasses
import types

import pytest

from multihost import launch
from multihost.testing import _marker
from multihost.testing import _merge

SPEC = _marker.GroupSpec('test_x.py', 2, 2, 60.0)


def _item() -> types.SimpleNamespace:
  """A stand-in for the parent's `pytest.Item` (the fields a report needs)."""
  return types.SimpleNamespace(
      nodeid='test_x.py::test_one', location=('test_x.py', 3, 'test_one'),
      keywords={'test_one': 1}, user_properties=[])


@dataclasses.dataclass
class _Crash:
  path: str
  lineno: int
  message: str


class _Longrepr:
  def __init__(self, text: str, message: str):
    self._text = text
    self.reprcrash = _Crash('test_x.py', 4, message)

  def __str__(self) -> str:
    return self._text


def _worker_report(outcome: str, *, longrepr=None, sections=(),
                   duration: float = 0.1, peer_failure: bool = False,
                   when: str = 'call') -> pytest.TestReport:
  report = pytest.TestReport('test_x.py::test_one',
                             ('test_x.py', 3, 'test_one'), {}, outcome,
                             longrepr, when, sections=list(sections),
                             duration=duration)
  setattr(report, _marker.PEER_FAILURE, peer_failure)
  return report


def test_a_failure_on_one_process_names_it_and_shows_its_traceback():
  failed = _worker_report(
      'failed', longrepr=_Longrepr('def test_one():\nE   AssertionError: p1',
                                   'AssertionError: p1'),
      sections=[('Captured stdout call', 'output of 1\n')], duration=0.3)
  # Process 0 passed; it only reports that process 1 failed.
  told = _worker_report('failed', longrepr='passed here, but ...',
                        peer_failure=True)
  merged = _merge.combine(_item(), SPEC, 'call', [told, failed])
  assert merged.outcome == 'failed' and merged.duration == 0.3
  text = str(merged.longrepr)
  assert text.splitlines()[0] == (
      'multihost: call failed on process(es) [1] of 2 '
      '(devices_per_process=2).')
  assert '[p1] E   AssertionError: p1' in text
  assert 'passed here' not in text
  assert merged.longrepr.reprcrash.message == '[p1] AssertionError: p1'
  assert merged.sections == [('Captured stdout call [p1]',
                              '[p1] output of 1\n')]


def test_skipped_everywhere_is_a_skip_and_passed_everywhere_a_pass():
  skip = ['test_x.py', 3, 'Skipped: no GPU']  # A tuple, once through JSON.
  merged = _merge.combine(_item(), SPEC, 'setup', [
      _worker_report('skipped', longrepr=skip, when='setup'),
      _worker_report('skipped', longrepr=skip, when='setup')])
  assert merged.outcome == 'skipped'
  assert merged.longrepr == ('test_x.py', 3, 'Skipped: no GPU')
  passed = _merge.combine(_item(), SPEC, 'call', [_worker_report('passed')] * 2)
  assert passed.outcome == 'passed' and passed.longrepr is None


def test_a_skip_on_only_some_processes_is_a_failure_that_says_so():
  merged = _merge.combine(_item(), SPEC, 'call', [
      _worker_report('passed'),
      _worker_report('skipped', longrepr=('test_x.py', 3, 'Skipped: odd'))])
  assert merged.outcome == 'failed'
  assert merged.longrepr == (
      'multihost: call was skipped on process(es) [1] (p1: Skipped: odd) but '
      'passed on [0]. Every process must make the same skip decision; skip '
      'before the test runs (a marker) or on every process.')


def _result(**kwargs) -> launch.LaunchResult:
  observed = launch.Observed(
      returncodes=kwargs.pop('returncodes', (-9, 7)),
      end_times=kwargs.pop('end_times', (2.0, 1.0)),
      pids=(100, 101), outputs=('line of p0\n', 'line of p1\n'), **kwargs)
  return launch.report(observed)


def test_a_test_cut_short_by_a_crash_names_the_process_and_shows_outputs():
  setup = {'setup': _worker_report('passed', when='setup')}
  merged = _merge.incomplete(_item(), SPEC, [dict(setup), dict(setup)],
                             _result(stopped=frozenset({0})),
                             group_started=True)
  assert merged.outcome == 'failed' and merged.when == 'call'
  assert merged.longrepr.splitlines()[0] == (
      'multihost: this test did not complete on processes [0, 1] of 2: the '
      'workers stopped early: process 1 ended first, exit status 7.')
  assert [title for title, _ in merged.sections] == [
      'Output of process 0 (last 1 lines)',
      'Output of process 1 (last 1 lines)']
  assert merged.sections[1][1] == '[p1] line of p1'


def test_a_timeout_and_tests_that_never_started_say_so():
  timed_out = _result(returncodes=(-9, -9), end_times=(60.0, 60.0),
                      stopped=frozenset({0, 1}), timed_out=True,
                      still_running_at_timeout=(0, 1))
  never = _merge.incomplete(_item(), SPEC, [{}, {}], timed_out,
                            group_started=True, when='setup')
  assert 'hit its timeout of 60 s and was stopped' in never.longrepr
  assert 'It never started' in never.longrepr
  assert never.sections == []  # Its output belongs to the test that hung.
  first = _merge.incomplete(_item(), SPEC, [{}, {}], timed_out,
                            group_started=False, when='setup')
  assert 'The workers failed before running any test' in first.longrepr
  assert len(first.sections) == 2


def test_group_timeouts_grow_with_the_machines_load():
  # Idle, a CPU per process: the marker's timeout; a 2-core machine busy
  # with other work: up to 4 times it; the variable overrides both.
  assert _marker.timeout_scale(2, environ={}, load=0.0, cpus=8) == 1.0
  assert _marker.timeout_scale(2, environ={}, load=3.0, cpus=2) == 2.5
  assert _marker.timeout_scale(2, environ={}, load=40.0, cpus=2) == 4.0
  variable = {_marker.TIMEOUT_SCALE_ENV: '1.5'}
  assert _marker.timeout_scale(2, environ=variable, load=40.0, cpus=2) == 1.5
  with pytest.raises(ValueError, match='give a positive number'):
    _marker.timeout_scale(2, environ={_marker.TIMEOUT_SCALE_ENV: '0'})
  scaled = _marker.GroupSpec('test_x.py', 2, 2, 15.0).scaled(2.5)
  assert (scaled.timeout, scaled.scale) == (37.5, 2.5)
  timed_out = _result(returncodes=(-9, -9), end_times=(37.5, 37.5),
                      stopped=frozenset({0, 1}), timed_out=True,
                      still_running_at_timeout=(0, 1))
  merged = _merge.incomplete(_item(), scaled, [{}, {}], timed_out,
                             group_started=True, when='setup')
  assert ("hit its timeout of 37.5 s (the marker's 15 s x 2.5: the machine's "
          'load, or $MULTIHOST_PYTEST_TIMEOUT_SCALE) and was stopped'
          ) in merged.longrepr, merged.longrepr
