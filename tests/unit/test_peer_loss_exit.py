"""The policy that makes a survivor leave after a peer failure (threads, one process).

The real-process drill (a SIGKILL during a jitted step) is in
tests/multiprocess/test_failures.py; these check the decision itself, fast.
"""

from __future__ import annotations

import threading
import time

import pytest

from multihost._src.liveness import peer_loss_exit


class _Exit:
  """Stands for os._exit: records the status instead of leaving."""

  def __init__(self):
    self.status: list[int] = []
    self.called = threading.Event()

  def __call__(self, status: int) -> None:
    self.status.append(status)
    self.called.set()


def _policy(grace=0.2, **kwargs):
  exit_fn = _Exit()
  policy = peer_loss_exit.PeerLossExit(exit_fn=exit_fn)
  policy.configure(enabled=True, grace=grace, **kwargs)
  return policy, exit_fn


def test_an_undelivered_failure_leaves_with_the_documented_status():
  policy, exit_fn = _policy(grace=0.2)
  hooked = []
  policy.configure(enabled=True, grace=0.2, before_exit=hooked.append)
  start = time.monotonic()
  policy.failure_seen([1, 3], prefix='[process=0]',
                      describe=lambda: 'main thread in train_step (x.py:7)')
  assert exit_fn.called.wait(5)
  assert time.monotonic() - start >= 0.2  # Not before the grace.
  assert exit_fn.status == [peer_loss_exit.EXIT_STATUS] == [75]
  assert hooked == [[1, 3]]  # The hook ran first, with the failed processes.


def test_the_line_names_the_processes_the_status_and_where(caplog):
  policy, exit_fn = _policy(grace=0.05)
  policy.failure_seen([2], prefix='[process=1]',
                      describe=lambda: 'main thread in train_step (x.py:7)')
  assert exit_fn.called.wait(5)
  err = caplog.text
  line = [l for l in err.splitlines() if 'leaving with exit status' in l]
  assert len(line) == 1, err
  assert '[process=1]' in line[0] and 'process(es) [2] failed' in line[0]
  assert 'exit status 75' in line[0]
  assert 'main thread in train_step (x.py:7)' in line[0]


def test_a_delivered_failure_never_leaves():
  policy, exit_fn = _policy(grace=0.3)
  policy.failure_seen([1], prefix='', describe=str)
  time.sleep(0.1)
  policy.delivered()  # A collective raised ProcessFailureError to the caller.
  assert not exit_fn.called.wait(0.6)


def test_a_failure_delivered_before_it_is_seen_never_leaves():
  policy, exit_fn = _policy(grace=0.05)
  policy.delivered()
  policy.failure_seen([1], prefix='', describe=str)
  assert not exit_fn.called.wait(0.4)


@pytest.mark.parametrize('how', ['disabled', 'cancelled'])
def test_opted_out_or_exiting_never_leaves(how):
  policy, exit_fn = _policy(grace=0.1)
  if how == 'disabled':
    policy.configure(enabled=False)
  policy.failure_seen([1], prefix='', describe=str)
  if how == 'cancelled':
    policy.cancel()
  assert not exit_fn.called.wait(0.5)


def test_a_hook_that_hangs_or_raises_does_not_keep_the_process():
  for hook in (lambda failed: time.sleep(30),
               lambda failed: 1 / 0):
    policy, exit_fn = _policy(grace=0.0, before_exit=hook, hook_timeout=0.3)
    start = time.monotonic()
    policy.failure_seen([1], prefix='', describe=str)
    assert exit_fn.called.wait(5)
    assert time.monotonic() - start < 3


def test_bad_settings_say_what_to_pass():
  policy = peer_loss_exit.PeerLossExit(exit_fn=_Exit())
  with pytest.raises(ValueError, match='grace must be a number of seconds'):
    policy.configure(enabled=True, grace=-1)
  with pytest.raises(TypeError, match='before_exit must be a callable'):
    policy.configure(enabled=True, before_exit='save')
