"""The plugin's worker side: one pytest session per controller, in step with its peers, writing its reports for the parent.

Each worker enters every test through a barrier (which also checks that all
run the same test) and leaves it through an exchange of pass/fail, so the
processes stay in step and fail together; its reports go to the parent as
JSON lines, serialized by pytest's own hooks (as pytest-xdist does).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import sys
import threading
import time
from typing import Any

import pytest

from multihost import env as env_lib
from multihost.testing import _marker

_KV_ROOT = 'multihost-pytest'


def exit_when_orphaned(parent_pid: int, results_dir: str) -> None:
  """Ends this worker when the pytest that launched it is gone.

  The parent stops its workers itself when it can; this covers a parent
  killed outright (SIGKILL), which would otherwise leave workers waiting at
  a barrier for up to the group's timeout.
  """
  while os.getppid() == parent_pid:
    time.sleep(0.5)
  try:  # Usually nobody reads this any more: the pipe's reader is gone.
    err = sys.__stderr__  # (None only without a stderr at all)
    if err is not None:
      err.write(
          f'[multihost.testing] the parent pytest (pid {parent_pid}) is '
          'gone; this worker exits.\n')
      err.flush()
  except (OSError, ValueError):
    pass
  finally:
    shutil.rmtree(results_dir, ignore_errors=True)  # The parent cannot.
    os._exit(3)


class WorkerSession:
  """Runs in each worker pytest session (registered there): initialize, barriers, results."""

  def __init__(self, config: pytest.Config, results_dir: str):
    import multihost  # Usually already initialized, before conftest.py.

    self._config = config
    self._dir = pathlib.Path(results_dir)
    self._index = int(os.environ.get(env_lib.PROCESS_ID, '0'))
    self._timeout = float(os.environ.get(_marker.BARRIER_TIMEOUT_ENV,
                                         _marker.DEFAULT_TIMEOUT_S))
    self._out = open(self._dir / f'p{self._index}.jsonl', 'a',
                     encoding='utf-8')
    self._seq = -1
    self._failed = False
    self._start_error: BaseException | None = None
    self._peer_failed: set[str] = set()
    multihost.initialize()
    threading.Thread(target=exit_when_orphaned,
                     args=(os.getppid(), results_dir),
                     daemon=True, name='multihost-worker-watchdog').start()

  def shared_path(self, item: pytest.Item) -> pathlib.Path:
    name = re.sub(r'[^\w.-]+', '_', item.name)[:60]
    path = self._dir / 'shared' / f'{self._seq:04d}-{name}'
    path.mkdir(parents=True, exist_ok=True)
    return path

  def _exchange(self, phase: str, payload: Any) -> list[Any]:
    """Gathers JSON-able `payload` from every process, in a namespace of its own.

    The keys and barrier are numbered by test, not by the collective call
    counter, so a test that left collectives unmatched on some process cannot
    pair them with these exchanges.
    """
    from multihost._src.control import rendezvous
    from multihost._src.runtime import coordination
    from multihost._src.runtime import process
    count = process.process_count()
    if count == 1:
      return [payload]
    prefix = f'{_KV_ROOT}/{self._seq}/{phase}/'
    # JSON, not pickle: reading a value written by anyone who can reach the
    # coordination service must not run code.
    coordination.kv_set(prefix + str(self._index),
                         json.dumps(payload).encode())
    rendezvous.barrier(prefix, f'pytest {phase} barrier',
                                timeout=self._timeout)
    messages: list[Any] = [None] * count
    for key, value in coordination.kv_dir(prefix):
      messages[int(key.rsplit('/', 1)[1])] = json.loads(value)
    return messages

  @pytest.hookimpl(tryfirst=True)
  def pytest_runtest_protocol(self, item: pytest.Item, nextitem) -> None:
    """Enters the test through a barrier that checks all run the same test."""
    del nextitem
    from multihost._src.runtime import calls
    self._seq += 1
    # Marks the test in the process's output, for crash and hang reports.
    err = sys.__stderr__  # (None only without a stderr at all)
    if err is not None:
      err.write(f'\n[multihost.testing] start {item.nodeid}\n')
      err.flush()
    self._failed = False
    self._start_error = None
    try:
      # Each process's next collective number: all restart from the largest,
      # so collectives stay matched even after a test left some unmatched.
      mine = (item.nodeid, calls.next_call_id())
      everyone = self._exchange('start', mine)
      ids = [m[0] for m in everyone]
      if len(set(ids)) != 1:
        raise RuntimeError(
            f'[process={self._index}] the worker processes are not running '
            f'the same test: {dict(enumerate(ids))}. This is a bug in '
            'multihost.testing; please report it.')
      calls.reset(max(m[1] for m in everyone) + 1)
    except BaseException as e:  # noqa: BLE001  Reported as the test's error.
      self._start_error = e
    return None

  @pytest.hookimpl(tryfirst=True)
  def pytest_runtest_setup(self, item: pytest.Item) -> None:
    if self._start_error is not None:
      item.session.shouldstop = (
          'multihost: the processes could not meet at the start of '
          f'{item.nodeid}')
      raise self._start_error

  @pytest.hookimpl(wrapper=True)
  def pytest_runtest_makereport(self, item: pytest.Item, call):
    report = yield
    if report.failed:
      self._failed = True
    if call.when != 'teardown' or self._start_error is not None:
      return report
    try:
      failed = self._exchange('end', self._failed)
    except BaseException as e:  # noqa: BLE001
      item.session.shouldstop = (
          f'multihost: the processes could not meet at the end of '
          f'{item.nodeid}')
      report.outcome = 'failed'
      report.longrepr = f'{type(e).__name__}: {e}'
      return report
    others = [i for i, f in enumerate(failed) if f and i != self._index]
    if others and not self._failed:
      report.outcome = 'failed'
      report.longrepr = (
          f'[process={self._index}] passed here, but the test failed on '
          f'process(es) {others}; see their output.')
      self._peer_failed.add(item.nodeid)
    return report

  def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
    """Sends the report to the parent, serialized by pytest itself (as pytest-xdist does)."""
    data = self._config.hook.pytest_report_to_serializable(
        config=self._config, report=report)
    data[_marker.PEER_FAILURE] = (report.when == 'teardown' and
                           report.nodeid in self._peer_failed)
    # One line per report, flushed: a worker killed mid-test loses only it.
    self._out.write(json.dumps(data, default=repr) + '\n')
    self._out.flush()

  @pytest.hookimpl(trylast=True)
  def pytest_sessionfinish(self, session: pytest.Session,
                           exitstatus: int) -> None:
    self._out.close()
    # Failed tests are reported through the results; a non-zero exit status
    # means the worker itself broke.
    if exitstatus == pytest.ExitCode.TESTS_FAILED:
      session.exitstatus = pytest.ExitCode.OK
