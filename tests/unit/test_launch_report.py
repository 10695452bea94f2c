"""Unit tests of the launcher's pure parts: the report (blame heuristic, first error by raise, exit status, summary), restarts and the run policy.

No process is started: the inputs are what the launcher would have observed.
"""

from __future__ import annotations

import dataclasses
import io
import signal
import threading

import pytest

from multihost import env as env_lib
from multihost import launch
from multihost.launch._src.policy import policy as _policy
from multihost.launch._src.policy import restarts as _restarts
from multihost.launch._src.processes import environment as _environment
from multihost.launch._src.processes import output as _output
from multihost.launch._src.report import evidence as _evidence

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


@pytest.mark.parametrize('kwargs, action', [
    (dict(exit_code=0), _policy.END),
    (dict(exit_code=137), _policy.RESTART),
    (dict(exit_code=137, restart_count=2), _policy.RESTART),
    (dict(exit_code=137, restart_count=3), _policy.END),
    (dict(exit_code=137, max_restarts=0), _policy.END),
    (dict(exit_code=130, interrupted=True), _policy.END),
    (dict(exit_code=124, timed_out=True), _policy.END),
    (dict(exit_code=1, time_left=0.0), _policy.END),
    (dict(exit_code=1, time_left=5.0), _policy.RESTART),
])
def test_policy_after_attempt_restarts_failures_only_while_restarts_last(
    kwargs, action):
  args = dict(timed_out=False, interrupted=False, restart_count=0,
              max_restarts=3) | kwargs
  assert _policy.after_attempt(**args) == action


NO_RETRY = env_lib.NO_RETRY_EXIT_STATUS


@pytest.mark.parametrize('kwargs, action', [
    # Restarts left: the first failure ends the attempt at once.
    (dict(returncodes=[None, KILL], end_times=[None, 4.9],
          restart_at_once=True), _policy.RESTART_NOW),
    (dict(returncodes=[None, None, 1], end_times=[None, None, 4.99],
          restart_at_once=True), _policy.RESTART_NOW),
    # None left: the others get the grace period.
    (dict(returncodes=[None, KILL], end_times=[None, 4.9]), _policy.WAIT),
    # Restarting will not help (78): no restart follows, so the grace too.
    (dict(returncodes=[None, NO_RETRY], end_times=[None, 4.9],
          restart_at_once=True), _policy.WAIT),
    (dict(returncodes=[None, NO_RETRY], end_times=[None, 4.0],
          grace_period=1.0, restart_at_once=True), _policy.GRACE_OVER),
    (dict(returncodes=[None, KILL, NO_RETRY], end_times=[None, 4.8, 4.9],
          restart_at_once=True), _policy.WAIT),
    # An exit 0 is no failure; an interrupt and the timeout come first.
    (dict(returncodes=[None, 0], end_times=[None, 1.0],
          restart_at_once=True), _policy.WAIT),
    (dict(returncodes=[None, KILL], end_times=[None, 4.9], interrupted=True,
          restart_at_once=True), _policy.INTERRUPTED),
    (dict(returncodes=[None, KILL], end_times=[None, 4.9], timeout=5.0,
          restart_at_once=True), _policy.TIMED_OUT),
    (dict(returncodes=[1, KILL], end_times=[4.9, 4.9],
          restart_at_once=True), _policy.ALL_EXITED),
])
def test_policy_restarts_at_once_while_restarts_are_left(kwargs, action):
  args = dict(elapsed=5.0, timeout=None, grace_period=15.0,
              interrupted=False) | kwargs
  step = _policy.next_step(**args)
  assert step.action == action
  if action == _policy.RESTART_NOW:
    assert step.running == tuple(
        i for i, rc in enumerate(kwargs['returncodes']) if rc is None)


def test_policy_does_not_retry_what_said_restarting_will_not_help():
  args = dict(timed_out=False, interrupted=False, restart_count=0,
              max_restarts=3)
  assert _policy.after_attempt(exit_code=NO_RETRY, no_retry=True,
                               **args) == _policy.END
  assert _policy.after_attempt(exit_code=137, no_retry=True,
                               **args) == _policy.END
  assert _policy.after_attempt(exit_code=NO_RETRY, **args) == _policy.RESTART
  assert _policy.restarts_left(restart_count=2, max_restarts=3)
  assert not _policy.restarts_left(restart_count=3, max_restarts=3)
  # The process that said so: the first by exit, never one the launcher
  # stopped (its status is the launcher's doing).
  assert _policy.not_retryable([0, 1, KILL]) is None
  assert _policy.not_retryable([NO_RETRY, 1, NO_RETRY],
                               end_times=[3.0, 1.0, 2.0]) == 2
  assert _policy.not_retryable([NO_RETRY, NO_RETRY]) == 0
  assert _policy.not_retryable([NO_RETRY, 1], stopped={0}) is None


def test_the_summary_says_why_a_failed_attempt_was_not_restarted():
  said = launch.report(_run([0, NO_RETRY], [1.0, 0.5]))
  result = _restarts.combine([said], starts=[0.0], max_restarts=3,
                             elapsed=1.0)
  assert result.exit_code == NO_RETRY and result.restart_count == 0
  assert result.summary.splitlines()[1] == (
      '  attempt 0 (MULTIHOST_RESTART_COUNT=0) at 0.0 s: process 1 failed '
      f'first (exit status {NO_RETRY}); not restarted: process 1 exited with '
      f'status {NO_RETRY}, which says restarting will not help (bad flags, a '
      'missing or unusable checkpoint, settings the processes disagree on); '
      'fix what [p1] names and run again.')
  # After a restart, too; a 78 the launcher caused (after SIGTERM) is not one.
  failed = launch.report(_run([0, KILL], [1.0, 0.5]))
  result = _restarts.combine([failed, said], starts=[0.0, 1.2],
                             max_restarts=3, elapsed=2.5)
  assert 'restarted all (restart 1 of 3).' in result.summary
  assert 'not restarted: process 1 exited with status' in result.summary
  stopped = launch.report(_run([NO_RETRY, KILL], [1.0, 0.5],
                               stopped=frozenset({0})))
  assert _restarts.not_retried(stopped) is None


def test_the_summary_says_the_others_were_stopped_at_once_to_restart():
  run = _run([KILL, KILL], [0.6, 0.5], stopped=frozenset({0}),
             grace_period=15.0, stopped_to_restart=True)
  summary = launch.report(run).summary
  assert ('Processes [0] were stopped at once, to restart the job (restarts '
          'are left).') in summary
  assert 'grace period' not in summary
  run = dataclasses.replace(run, stopped_to_restart=False)
  assert 'were stopped after the 15 s grace period' in launch.report(
      run).summary


def _timed(lines_and_times) -> tuple[str, tuple[float, ...]]:
  """One process's output and its line times from [(time, line), ...]."""
  return (''.join(line + '\n' for _, line in lines_and_times),
          tuple(t for t, _ in lines_and_times))


_TRACEBACK = [
    'Traceback (most recent call last):',
    '  File "train.py", line 7, in <module>',
    '    load()',
    'ValueError: bad batch',
    '',
    'The above exception was the direct cause of the following exception:',
    '',
    'Traceback (most recent call last):',
    '  File "train.py", line 9, in <module>',
    '    raise RuntimeError(\'step 3 failed\') from e',
    '    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^',
    'RuntimeError: step 3 failed',
    'on two lines',
]


def _raising_run(*, p0_exit, p0_end, p1_exit, p1_end, stopped=frozenset(),
                 **kwargs) -> launch.Observed:
  out0, times0 = _timed([(0.1, 'starting')] +
                        [(0.4, line) for line in _TRACEBACK])
  out1, times1 = _timed([(0.2, 'loading data'), (2.0, 'still loading')])
  return launch.Observed(returncodes=(p0_exit, p1_exit),
                         end_times=(p0_end, p1_end), pids=(100, 101),
                         outputs=(out0, out1), line_times=(times0, times1),
                         stopped=stopped, **kwargs)


def test_the_first_error_is_the_first_raise_not_the_first_exit():
  # Process 0 raised at 0.4 s, then lingered (an exit handshake) until 6 s;
  # process 1 exited 1 at 3 s.
  result = launch.report(_raising_run(p0_exit=1, p0_end=6.0, p1_exit=1,
                                      p1_end=3.0))
  assert result.first_failure == 0
  assert result.exit_code == 1
  assert result.first_error == 'RuntimeError: step 3 failed'
  lines = result.summary.splitlines()
  assert ('  [p0] pid 100: exit status 1 at 6.0 s, raised at 0.4 s  <- '
          'failed first') in lines
  assert ('First failure: process 0 (exit status 1). Look at its output '
          '([p0]).') in lines
  assert ('Process 0 raised first, at 0.4 s (when the launcher read its '
          'traceback): RuntimeError: step 3 failed') in lines
  assert ("Meanwhile, at 0.4 s: p1 was running (last line at 0.2 s: "
          "'loading data').") in lines
  # Process 0 only raised first; it did not die before the others.
  assert 'hosts the JAX coordination service' not in result.summary
  # Without line times, the first exit is the first failure, as before.
  untimed = dataclasses.replace(_raising_run(
      p0_exit=1, p0_end=6.0, p1_exit=1, p1_end=3.0), line_times=())
  assert launch.report(untimed).first_failure == 1


def test_a_process_that_raised_and_was_stopped_is_still_the_first_error():
  # The run: process 0 raised, then waited at exit for a stuck peer
  # until the timeout stopped both.
  result = launch.report(_raising_run(
      p0_exit=KILL, p0_end=30.0, p1_exit=KILL, p1_end=30.0,
      stopped=frozenset({0, 1}), timed_out=True,
      still_running_at_timeout=(0, 1)))
  assert result.first_failure == 0
  assert result.exit_code == launch.TIMEOUT_EXIT_STATUS
  assert '<- failed first (then stopped by the launcher)' in result.summary
  assert 'Timed out' in result.summary
  assert ('First failure: process 0 (it raised, then the launcher stopped '
          'it: killed by SIGKILL (status 137))') in result.summary
  assert 'Processes [0, 1] were stopped at the timeout.' in result.summary
  assert 'RuntimeError: step 3 failed' in result.summary
  assert ("p1 was running (last line at 0.2 s: 'loading data')"
          in result.summary)
  # Stopped after it raised, with another's exit after: that exit's status.
  result = launch.report(_raising_run(
      p0_exit=KILL, p0_end=20.0, p1_exit=5, p1_end=3.0,
      stopped=frozenset({0})))
  assert result.first_failure == 0 and result.exit_code == 5


def test_a_traceback_of_a_process_that_then_exited_0_is_not_blamed():
  result = launch.report(_raising_run(p0_exit=0, p0_end=6.0, p1_exit=1,
                                      p1_end=3.0))
  assert result.first_failure == 1
  assert result.first_error is None


def test_a_traceback_that_names_a_failed_peer_does_not_make_it_first():
  # Process 1 was partitioned: process 0 raised ProcessFailureError naming
  # it at 10 s, JAX aborted process 1 at 11 s, process 0 left at 13 s.
  out0, times0 = _timed([
      (10.0, 'Traceback (most recent call last):'),
      (10.0, '  File "train.py", line 3, in <module>'),
      (10.0, 'multihost.ProcessFailureError: [process=0] step: process(es) '
             '[1] failed (the coordination service stopped receiving their '
             'heartbeats)')])
  out1, times1 = _timed([(1.0, 'F1201 ' + launch.LOST_SERVICE_MARKER)])
  run = launch.Observed(returncodes=(3, ABRT), end_times=(13.0, 11.0),
                        pids=(100, 101), outputs=(out0, out1),
                        line_times=(times0, times1))
  assert launch.report(run).first_failure == 1


def test_what_the_others_were_doing_at_the_first_failure():
  out1, times1 = _timed([(0.5, 'step 1'), (1.5, 'step 2'),
                         (4.0, 'Traceback (most recent call last):'),
                         (4.0, 'TimeoutError: peer gone')])
  run = launch.Observed(returncodes=(KILL, 1, 0), end_times=(2.0, 4.5, 1.0),
                        pids=(100, 101, 102), outputs=('', out1, ''),
                        line_times=((), times1, ()), host_service=True)
  result = launch.report(run)
  assert result.first_failure == 0
  assert ("Meanwhile, at 2.0 s: p1 was running (last line at 1.5 s: "
          "'step 2'), then raised 'TimeoutError: peer gone' at 4.0 s; p2 had "
          "exited at 1.0 s (exit status 0).") in result.summary


def test_first_raised_takes_the_last_exception_of_a_chain():
  lines = ['noise'] + _TRACEBACK
  raised = _evidence.first_raised(lines, [0.0] + [1.5] * len(_TRACEBACK))
  assert raised == _evidence.Raised(time=1.5,
                                      error='RuntimeError: step 3 failed')
  assert _evidence.first_raised(['all fine'], [0.0]) is None
  assert _evidence.first_raised(lines, []) is None  # Times unknown.
  single = ['Traceback (most recent call last):', '  File "x", line 1',
            'KeyError: 3', 'after the traceback']
  assert _evidence.first_raised(single, [2.0] * 4).error == 'KeyError: 3'


def test_first_raised_skips_blank_lines_inside_a_chained_message():
  # As a CollectiveTimeoutError raised from JAX's multi-line barrier error.
  lines = [
      'Traceback (most recent call last):',
      '  File "multihost/_src/runtime/coordination.py", line 57, in wait_at_barrier',
      'jax.errors.JaxRuntimeError: DEADLINE_EXCEEDED: Barrier timed out.',
      'The first task at the barrier: 0. Some timed out task names:',
      '1', '', '',
      'RPC: /xla.coordination.CoordinationService/Barrier',
      '',
      'The above exception was the direct cause of the following exception:',
      '',
      'Traceback (most recent call last):',
      '  File "train.py", line 8, in <module>',
      "multihost._src.runtime.errors.CollectiveTimeoutError: [process=0] "
      "sync_global_devices('x'): timed out after 5.0 s",
      'W1201 preemption_notifier.cc:90] SIGTERM caught',
  ]
  raised = _evidence.first_raised(lines, [3.0] * (len(lines) - 1) + [9.0])
  assert raised.error.startswith(
      "multihost._src.runtime.errors.CollectiveTimeoutError: [process=0] "
      "sync_global_devices('x')"), raised
  # A later, separate traceback is not part of the first one's chain.
  later = lines[:9] + ['another line'] + lines[11:]
  assert _evidence.first_raised(later, [3.0] * len(later)).error.startswith(
      'jax.errors.JaxRuntimeError: DEADLINE_EXCEEDED')
  # Nor is a chain link read long after the first line.
  late = [3.0] * 11 + [9.0] * (len(lines) - 11)
  assert _evidence.first_raised(lines, late).error.startswith(
      'jax.errors.JaxRuntimeError')


def test_the_summary_names_simulated_hosts():
  run = launch.Observed(returncodes=(0, 0), end_times=(1.0, 1.0),
                        pids=(100, 101), outputs=('', ''), hosts='netns',
                        host_addresses=('10.9.0.1', '10.9.0.2'))
  lines = launch.report(run).summary.splitlines()
  assert lines[0].startswith(
      'multihost.launch: 2 process(es) x 1 CPU device(s) on 2 simulated '
      'host(s) (--hosts=netns: a network namespace and address each), ')
  assert lines[1] == '  [p0] pid 100 on 10.9.0.1: exit status 0 at 1.0 s'
  plain = launch.report(_run([0, 0], [1.0, 1.0])).summary
  assert 'simulated' not in plain and ' on 10.' not in plain


def test_restarts_summary_lists_every_attempt_and_its_cause():
  failed = launch.report(_run([0, KILL], [1.0, 0.5]))
  passed = launch.report(_run([0, 0], [1.0, 1.0]))
  result = _restarts.combine([failed, passed], starts=[0.0, 1.2],
                             max_restarts=3, elapsed=2.5)
  assert result.ok and result.restart_count == 1
  assert result.attempts == (failed, passed)
  lines = result.summary.splitlines()
  assert lines[:3] == [
      'multihost.launch: 2 attempt(s) (--max_restarts=3), 2.5 s in all, '
      'exit status 0.',
      '  attempt 0 (MULTIHOST_RESTART_COUNT=0) at 0.0 s: process 1 failed '
      'first (killed by SIGKILL (status 137)); restarted all (restart 1 of '
      '3).',
      '  attempt 1 (MULTIHOST_RESTART_COUNT=1) at 1.2 s: every process '
      'exited 0; the run succeeded.']
  assert lines[3] == 'The last attempt (1):'
  assert result.summary.endswith(passed.summary)
  # Out of restarts: the last failure's status.
  ended = _restarts.combine([failed, failed], starts=[0.0, 1.0],
                            max_restarts=1, elapsed=2.0)
  assert ended.exit_code == 137 and ended.restart_count == 1
  assert 'no restarts left (--max_restarts=1).' in ended.summary
  # No restarts allowed: the one attempt's summary, as without restarts.
  alone = _restarts.combine([failed], starts=[0.0], max_restarts=0,
                            elapsed=1.0)
  assert alone.summary == failed.summary and alone.attempts == (failed,)


def test_python_controllers_are_labelled_for_ps():
  assert _environment.labelled(['/v/bin/python3.11', 'train.py', '-x'], 2) == [
      '/v/bin/python3.11', '-X', 'multihost_process=2', 'train.py', '-x']
  assert _environment.labelled(['python', '-m', 'pytest'], 0)[:3] == [
      'python', '-X', 'multihost_process=0']
  assert _environment.labelled(['sh', '-c', 'true'], 1) == ['sh', '-c', 'true']
  assert _environment.labelled(['/bin/pythonic-tool'], 1) == [
      '/bin/pythonic-tool']


def test_the_last_line_drops_a_log_lines_header():
  lines = ['I1203 05:33:27.779300 140354341141376 loop.py:208] [process=0] '
           'step 1200/2000 loss 5.4e-16 79.5 steps/s', '']
  assert _evidence.last_line_before(lines, [1.0, 1.1], 2.0) == (
      1.0, '[process=0] step 1200/2000 loss 5.4e-16 79.5 steps/s')
  assert _evidence.last_line_before(['plain line'], [1.0], 2.0) == (
      1.0, 'plain line')


def test_held_output_keeps_tracebacks_back_and_releases_them_in_order():
  stream = io.StringIO()
  output = _output.Output(1, changed=threading.Condition(), stream=stream)
  output.hold_tracebacks()
  chain = ['Traceback (most recent call last):', '  File "t.py", line 1',
           '    boom()', 'ValueError: bad batch', '',
           'The above exception was the direct cause of the following '
           'exception:', '', 'Traceback (most recent call last):',
           '  File "t.py", line 3', 'RuntimeError: step 3 failed']
  text = ['starting', *chain,
          'E1203 05:33:27.779300 1 loop.py:9] [process=0] a log line']
  output.pump(0, io.BytesIO(''.join(f'{t}\n' for t in text).encode()))
  assert stream.getvalue() == ('[p0] starting\n[p0] E1203 05:33:27.779300 1 '
                               'loop.py:9] [process=0] a log line\n')
  assert output.held() == len(chain)
  assert output.text(0) == ''.join(f'{t}\n' for t in text)  # All captured.
  output.release()
  assert stream.getvalue().splitlines()[2:] == [f'[p0] {t}' for t in chain]
  # Holding everything (the attempt failed), then dropping it (it heals).
  output.hold_all()
  output.pump(0, io.BytesIO(b'stopped\n'))
  assert output.drop_held() == 1 and 'stopped' not in stream.getvalue()
