"""Unit tests of the launcher's pure parts: the report (blame heuristic, exit status, summary) and the run policy.

No process is started: the inputs are what the launcher would have observed.
"""

from __future__ import annotations

import signal

import pytest

from multihost import launch
from multihost.launch import _policy

KILL = -signal.SIGKILL
ABRT = -signal.SIGABRT


def _run(returncodes, end_times, **kwargs) -> launch.Observed:
  n = len(returncodes)
  return launch.Observed(returncodes=tuple(returncodes),
                         end_times=tuple(end_times),
                         pids=tuple(range(100, 100 + n)),
                         outputs=('',) * n, **kwargs)


def test_all_passed():
  result = launch.report(_run([0, 0], [1.0, 1.1]))
  assert result.ok and result.exit_code == 0
  assert result.first_failure is None
  assert 'exit status 0.' in result.summary.splitlines()[0]


def test_the_earliest_failure_is_blamed_and_sets_the_status():
  result = launch.report(_run([KILL, 3, KILL], [2.0, 1.0, 2.0],
                              stopped=frozenset({0, 2}), grace_period=0.5))
  assert result.first_failure == 1
  assert result.exit_code == 3
  assert result.stopped == (0, 2)
  assert 'First failure: process 1 (exit status 3)' in result.summary
  assert 'were stopped after the 0.5 s grace period' in result.summary
  assert '[p0] pid 100: killed by SIGKILL (status 137) at 2.0 s  (stopped' in (
      result.summary)


def test_a_signal_gives_128_plus_its_number():
  result = launch.report(_run([0, -signal.SIGSEGV], [1.0, 0.5]))
  assert result.exit_code == 128 + signal.SIGSEGV
  assert 'First failure: process 1 (killed by SIGSEGV' in result.summary


def test_process_0_dying_first_is_blamed_not_the_aborted_survivors():
  result = launch.report(_run([KILL, ABRT, ABRT], [1.0, 2.0, 2.1]))
  assert result.first_failure == 0
  assert result.exit_code == 128 + signal.SIGKILL
  assert ('Process 0, which hosts the JAX coordination service, died first: '
          'killed by SIGKILL') in result.summary
  assert 'aborted the other processes [1, 2] (SIGABRT)' in result.summary
  assert 'they are not the cause' in result.summary


def test_process_0_is_blamed_when_the_aborts_were_reaped_just_before_it():
  # The reaper threads saw the survivors' SIGABRT 0.3 s before process 0's
  # SIGKILL: the runtime aborted them because process 0 was gone.
  assert launch.report(_run([KILL, ABRT], [1.3, 1.0])).first_failure == 0


def test_an_abort_process_0_reported_as_a_failure_keeps_the_blame():
  # Process 0 raised ProcessFailureError naming process 1 (partitioned, then
  # aborted by JAX), and left just after the abort: process 1 is the cause.
  outputs = ('ERROR at 1.0 ProcessFailureError: [process=0] save checkpoint '
             'step 3: process(es) [1] failed (the coordination service '
             'stopped receiving their heartbeats)\n',
             'F1201 client.cc:1] ' + launch.LOST_SERVICE_MARKER + '\n')
  run = launch.Observed(returncodes=(3, ABRT), end_times=(1.3, 1.0),
                        pids=(100, 101), outputs=outputs)
  result = launch.report(run)
  assert result.first_failure == 1 and result.exit_code == 128 + 6
  assert 'First failure: process 1 (killed by SIGABRT' in result.summary
  assert 'Process 1 lost the coordination service' in result.summary
  # Naming another process does not count.
  other = ('process(es) [2] failed', outputs[1], '')
  assert launch.report(launch.Observed(
      returncodes=(3, ABRT, ABRT), end_times=(1.3, 1.0, 1.4),
      pids=(100, 101, 102), outputs=other)).first_failure == 0


def test_an_abort_well_before_process_0_died_is_blamed_on_its_own():
  result = launch.report(_run([KILL, ABRT], [3.0, 1.0]))
  assert result.first_failure == 1
  assert 'First failure: process 1 (killed by SIGABRT' in result.summary


def test_a_non_abort_failure_just_before_process_0_keeps_the_blame():
  assert launch.report(_run([KILL, 3], [1.1, 1.0])).first_failure == 1


def test_process_0_that_aborted_itself_is_not_promoted():
  assert launch.report(_run([ABRT, ABRT], [1.1, 1.0])).first_failure == 1


def test_with_a_hosted_service_process_0_is_an_ordinary_failure():
  result = launch.report(_run([KILL, 3, 3], [1.0, 4.0, 4.0],
                              host_service=True))
  assert result.first_failure == 0
  assert 'hosts the JAX coordination service' not in result.summary
  assert 'First failure: process 0 (killed by SIGKILL' in result.summary


def test_survivors_that_failed_differently_are_listed():
  result = launch.report(_run([KILL, ABRT, 1], [1.0, 2.0, 2.0]))
  assert ('aborted the other processes [1, 2] (p1: killed by SIGABRT '
          '(status 134), p2: exit status 1)') in result.summary


def test_processes_the_launcher_stopped_are_never_blamed():
  result = launch.report(_run([KILL, 0], [1.0, 0.5], stopped=frozenset({0}),
                              timed_out=True, still_running_at_timeout=(0,)))
  assert result.first_failure is None
  assert result.exit_code == launch.TIMEOUT_EXIT_STATUS == 124
  assert 'processes [0] were still running' in result.summary


def test_an_interrupt_sets_the_status():
  result = launch.report(_run([-signal.SIGINT, KILL], [1.0, 2.0],
                              stopped=frozenset({0, 1}),
                              interrupted_by=signal.SIGINT))
  assert result.exit_code == 128 + signal.SIGINT
  assert 'Interrupted by SIGINT' in result.summary


def test_describe_and_status_of():
  assert launch.describe(None) == 'still running'
  assert launch.describe(2) == 'exit status 2'
  assert launch.describe(KILL) == 'killed by SIGKILL (status 137)'
  assert launch.status_of(KILL) == 137 and launch.status_of(4) == 4
  assert launch.signal_name(200) == 'signal 200'


@pytest.mark.parametrize('kwargs, action', [
    (dict(returncodes=[0, 0], end_times=[1, 1]), _policy.ALL_EXITED),
    (dict(returncodes=[None, 0], end_times=[None, 1], interrupted=True),
     _policy.INTERRUPTED),
    (dict(returncodes=[None, None], end_times=[None, None], timeout=5.0),
     _policy.TIMED_OUT),
    (dict(returncodes=[None, 1], end_times=[None, 4.0], grace_period=1.0),
     _policy.GRACE_OVER),
    (dict(returncodes=[None, 1], end_times=[None, 4.5], grace_period=1.0),
     _policy.WAIT),
    (dict(returncodes=[None, 0], end_times=[None, 1.0]), _policy.WAIT),
])
def test_policy_next_step(kwargs, action):
  args = dict(elapsed=5.0, timeout=None, grace_period=15.0,
              interrupted=False) | kwargs
  assert _policy.next_step(**args).action == action


def test_policy_waits_until_the_nearest_deadline():
  step = _policy.next_step(elapsed=5.0, returncodes=[None, 1],
                           end_times=[None, 4.95], timeout=None,
                           grace_period=0.1, interrupted=False)
  assert step.action == _policy.WAIT
  assert step.pause == pytest.approx(0.05)
  assert step.running == (0,)
