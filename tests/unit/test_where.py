"""Where-reports in one process: the single-process report and stall threshold, and the straggler statistic (the real-controller drills are in tests/multiprocess/test_where_processes.py)."""

from __future__ import annotations

import pytest

import multihost
from multihost import env as env_lib
from multihost._src.diagnostics import where
from multihost._src.diagnostics import where_text


def test_straggler_statistics_name_the_process_that_waited_least():
  # Process 2 waits least (it arrives last) in 9 of 10 calls.
  waits = [{c: 0.010 for c in range(10)}, {c: 0.008 for c in range(10)},
           {c: 0.001 for c in range(10)}]
  waits[2][4] = 0.009
  waits[1][4] = 0.0
  report = multihost.StragglerReport.from_waits(waits)
  assert report.calls == 10
  assert report.last_counts == (0, 1, 9)
  assert report.consistently_last == 2
  assert report.skew_when_last[2] == pytest.approx(0.009)
  assert report.max_skew == pytest.approx(0.010)
  assert 'process 2 came last to 9 of the last 10' in report.summary()
  even = multihost.StragglerReport.from_waits(
      [{c: 0.0 + (c % 2) for c in range(10)},
       {c: 1.0 - (c % 2) for c in range(10)}])
  assert even.consistently_last is None
  assert 'no consistent straggler' in even.summary()


def test_single_process_where_and_stall_threshold(monkeypatch):
  report = multihost.where()
  assert '[process=0] where: pid' in report
  assert 'test_single_process_where_and_stall_threshold' in report
  monkeypatch.setenv(env_lib.STALL_REPORT_AFTER, '7')
  assert multihost.stall_report_after() == 7.0
  multihost.set_stall_report_after(0)
  assert multihost.stall_report_after() == 0.0
  multihost.set_stall_report_after(None)
  assert multihost.stall_report_after() == 7.0
  with pytest.raises(ValueError, match='>= 0'):
    multihost.set_stall_report_after(-1)
  monkeypatch.setenv(env_lib.STALL_REPORT_AFTER, 'soon')
  with pytest.raises(ValueError, match='MULTIHOST_STALL_REPORT_AFTER'):
    multihost.stall_report_after()




def test_a_short_stack_ends_with_the_program_s_own_innermost_frame():
  frames = [['bin/train.py', 9, 'main'], ['run/loop.py', 266, 'run']] + [
      ['lib/deep.py', n, f'f{n}'] for n in range(8)]
  report = {'threads': [{'name': 'MainThread', 'main': True,
                         'frames': frames, 'program': frames[0]}]}
  line = where_text.main_thread({**report, 'last': None, 'now_in': None})
  assert line.startswith('main thread in f7 (lib/deep.py:7) <- f6 '), line
  assert ('<- f2 (lib/deep.py:2) <- ... <- main (bin/train.py:9);' in line
          and 'f1 ' not in line), line
  # Among the innermost frames already: shown once, in its place.
  report['threads'][0]['frames'] = frames[:4]
  line = where_text.main_thread({**report, 'last': None, 'now_in': None})
  assert line.count('main (bin/train.py:9)') == 1 and '...' not in line, line
  # The report names the program's innermost frame (this process's main
  # module is the test runner's), or None where there is none.
  mine = where.local_report()['threads'][0]
  assert mine['main'] and 'program' in mine, mine
