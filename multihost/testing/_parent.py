"""The plugin's parent side: groups marked tests, runs each group in one launch of workers, reports each test.

The parent pytest never initializes `jax.distributed`; it launches N worker
pytest sessions (`multihost.launch`), reads the reports they wrote, and
hands pytest one merged report per phase (`_merge`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

import pytest

from multihost import env as env_lib
from multihost.testing import _marker
from multihost.testing import _merge

# Workers move in step, so after one crashes the others can only wait for it.
_GRACE_PERIOD_S = 2.0


def read_records(path: str) -> list[dict[str, Any]]:
  """The serialized reports a worker wrote to `path`, one JSON line each, up to a torn last line."""
  try:
    with open(path, encoding='utf-8') as f:
      lines = f.read().splitlines()
  except FileNotFoundError:
    return []
  records = []
  for line in lines:
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:  # A worker killed mid-write.
      break
  return records


def worker_command(config: pytest.Config,
                   items: list[pytest.Item]) -> list[str]:
  """The pytest command line every worker of a group runs: the group's tests, in the parent's style."""
  # tee-sys: a test's prints reach its report AND the process's output,
  # which the parent shows when a worker crashes or hangs mid-test.
  command = [sys.executable, '-m', 'pytest', '-q', '--no-header',
             '--capture=tee-sys', '-p', 'no:cacheprovider',
             f'--rootdir={config.rootpath}',
             # The workers render tracebacks; in the parent's style.
             f'--tb={config.getoption("tbstyle", "auto")}']
  if config.getoption('showlocals', False):
    command.append('--showlocals')
  if config.inipath is not None:
    command.append(f'--config-file={config.inipath}')
  plugin = sys.modules[__package__]  # multihost.testing
  if (config.pluginmanager.get_plugin('multihost') is not plugin or
      os.environ.get(env_lib.PYTEST_DISABLE_PLUGIN_AUTOLOAD)):
    command += ['-p', 'multihost.testing']
  return command + [item.nodeid for item in items]


class ParentSession:
  """Runs marked tests' groups in workers and reports them one by one (registered in the parent pytest)."""

  def __init__(self, config: pytest.Config):
    self._config = config
    self._groups: dict[_marker.GroupSpec, list[pytest.Item]] = {}
    # nodeid -> per process -> when -> the worker's report; filled as groups
    # run.
    self._records: dict[str, list[dict[str, pytest.TestReport]]] = {}
    self._launch_info: dict[_marker.GroupSpec, Any] = {}
    # Seconds of a group's launch not spent in its tests (process start,
    # jax.distributed, collection), charged to its first test's setup.
    self._overhead: dict[_marker.GroupSpec, float] = {}
    # Per group, its spec with the timeout it ran under (`timeout_scale`).
    self._scaled: dict[_marker.GroupSpec, _marker.GroupSpec] = {}
    self.launches = 0

  def pytest_collection_finish(self, session: pytest.Session) -> None:
    self._groups.clear()
    for item in session.items:
      spec = _marker.marker_spec(item)
      if spec is not None:
        self._groups.setdefault(spec, []).append(item)

  @pytest.hookimpl(tryfirst=True)
  def pytest_runtest_protocol(self, item: pytest.Item,
                              nextitem: pytest.Item | None) -> bool | None:
    spec = _marker.marker_spec(item)
    if spec is None:
      return None
    if spec.hosts is not None:
      from multihost import netns  # pylint: disable=g-import-not-at-top
      ok, why = netns.available()
      if not ok:  # pytest's own runner reports the skip.
        item.add_marker(pytest.mark.skip(reason=f'hosts={spec.hosts!r}: {why}'))
        return None
    if spec not in self._launch_info:
      self._run_group(spec, item)
    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = self._reports(item, spec)
    # The test ran elsewhere, but the parent's fixtures of earlier unmarked
    # tests (module or class scope) that `nextitem` does not need end here,
    # as pytest's own runner would end them.
    teardown = getattr(item.session, '_setupstate', None)
    if teardown is not None:
      try:
        teardown.teardown_exact(nextitem)
      except Exception:  # noqa: BLE001  Reported like pytest does.
        reports[-1] = _merge.make_report(item, 'teardown', 'failed',
                                         traceback.format_exc())
    for report in reports:
      ihook.pytest_runtest_logreport(report=report)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True

  def _run_group(self, spec: _marker.GroupSpec, first: pytest.Item) -> None:
    """Runs every test of the group in one launch; stores their results."""
    from multihost import launch  # Not at import: keep plugin loading cheap.

    # Never an empty list: workers given no test would run the whole suite.
    items = self._groups.get(spec) or [first]
    config = self._config
    try:
      scaled = spec.scaled(_marker.timeout_scale(spec.num_processes))
    except ValueError as e:
      raise pytest.UsageError(str(e)) from None
    self._scaled[spec] = scaled
    results_dir = tempfile.mkdtemp(prefix='multihost-pytest-')
    env = {_marker.WORKER_ENV: results_dir,
           _marker.BARRIER_TIMEOUT_ENV: str(scaled.timeout)}
    if not os.environ.get(env_lib.TIMEOUT):  # (The marker's, unscaled.)
      env[env_lib.TIMEOUT] = str(
          min(_marker.DEFAULT_COLLECTIVE_TIMEOUT_S, spec.timeout / 2))
    start = time.monotonic()
    try:
      # SIGINT/SIGTERM/SIGHUP to this pytest (Ctrl-C, `timeout`, a closed
      # terminal) first stop the workers, then act as they would have.
      result = launch.launch(
          worker_command(config, items), num_processes=spec.num_processes,
          devices_per_process=spec.devices_per_process,
          timeout=scaled.timeout,
          env=env, cwd=config.rootpath, grace_period=_GRACE_PERIOD_S,
          kill_wait=1.0, hosts=spec.hosts, forward_signals=(
              threading.current_thread() is threading.main_thread()))
      if result.interrupted_by == signal.SIGINT:
        raise KeyboardInterrupt
      if result.interrupted_by is not None:
        shutil.rmtree(results_dir, ignore_errors=True)  # No `finally` after.
        signal.raise_signal(result.interrupted_by)
      self.launches += 1
      self._launch_info[spec] = result
      for i in range(spec.num_processes):
        path = os.path.join(results_dir, f'p{i}.jsonl')
        for data in read_records(path):
          report = config.hook.pytest_report_from_serializable(
              config=config, data=data)
          per_process = self._records.setdefault(
              report.nodeid, [{} for _ in range(spec.num_processes)])
          per_process[i][report.when] = report
      in_tests = sum(
          max((sum(r.duration for r in p.values())
               for p in self._records.get(item.nodeid, [])), default=0.0)
          for item in items)
      self._overhead[spec] = max(0.0, time.monotonic() - start - in_tests)
    finally:
      shutil.rmtree(results_dir, ignore_errors=True)

  def _reports(self, item: pytest.Item,
               spec: _marker.GroupSpec) -> list[pytest.TestReport]:
    n = spec.num_processes
    per_process = self._records.get(item.nodeid, [{} for _ in range(n)])
    result = self._launch_info[spec]
    group_started = any(self._records.get(other.nodeid)
                        for other in self._groups.get(spec, []))
    reports = []
    for when in ('setup', 'call', 'teardown'):
      records = [p.get(when) for p in per_process]
      got = [r for r in records if r is not None]
      if len(got) < len(records):
        reports.append(_merge.incomplete(item, self._scaled.get(spec, spec),
                                         per_process, result,
                                         group_started=group_started,
                                         when=when))
        break
      reports.append(_merge.combine(item, spec, when, got))
      if when == 'setup' and reports[-1].outcome != 'passed':
        break  # Like pytest: no call phase after a failed or skipped setup.
    if reports[-1].when != 'teardown':
      reports.append(_merge.make_report(item, 'teardown', 'passed', None))
    group = self._groups.get(spec, [])
    if group and group[0] is item:  # Shows the launch cost in --durations.
      reports[0].duration += self._overhead.get(spec, 0.0)
    return reports
