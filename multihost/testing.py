"""Pytest plugin: runs a marked test's body in N real JAX controllers on this machine and reports it once.

Installing the package enables the plugin (`pytest11` entry point
`multihost`). Only with plugin autoloading disabled
(PYTEST_DISABLE_PLUGIN_AUTOLOAD=1) add `-p multihost.testing`; with it
enabled, that flag would register the plugin twice, which pytest refuses.

Mark a test and it runs in `num_processes` real controllers (`jax.distributed`
over gloo on localhost), each with `devices_per_process` CPU devices:

  import jax
  import multihost
  import pytest

  @pytest.mark.multihost(num_processes=2, devices_per_process=2)
  def test_allgather():
    out = multihost.process_allgather(jax.numpy.array([jax.process_index()]))
    assert out.tolist() == [[0], [1]]

  @pytest.mark.multihost(num_processes=2, timeout=120)
  def test_shared_files(multihost_tmp_path):  # the same folder on every process
    ...

How it runs:
- The test passes only if it passes on every process. When it fails on some,
  the report names them and shows each process's traceback and captured
  output, labelled `[p0]`, `[p1]`, ... Workers send their reports with
  pytest's own serialization hooks (`pytest_report_to_serializable`, as
  pytest-xdist does), so tracebacks keep pytest's style; the parent's
  `--tb` and `--showlocals` apply in the workers.
- Every process enters each test through a barrier (which also checks that
  they all run the same test) and leaves it through an exchange of pass/fail,
  so processes stay in step and fail together: a process whose own run passed
  reports that the test failed on process N.
- Marked tests that share (module, num_processes, devices_per_process,
  timeout) run as a group in ONE launch: N worker pytest sessions, one per
  process, started once, each calling `multihost.initialize()` before any
  test touches JAX. The parent pytest reports each test individually.
- The launch's own cost (starting N processes, `jax.distributed`, collection)
  is reported as the setup time of the group's first test, so
  `pytest --durations` shows what each group costs.
- Ctrl-C, SIGTERM (e.g. from `timeout`) or SIGHUP to the parent pytest
  stop the running group's workers first; a worker whose parent pytest is
  killed outright exits within a second.
- `timeout=` (seconds, default 300) bounds the whole group. If a worker
  crashes or hangs, the group's remaining tests fail with each process's
  output, and no worker is left running.
- In workers, collectives time out after $MULTIHOST_TIMEOUT seconds, default
  60 here (or half the group timeout if smaller), so a test that leaves a
  peer waiting in a collective fails instead of hanging.
- Workers initialize `jax.distributed` before your conftest.py files are
  imported. If conftest.py sets `jax_num_cpu_devices` (for fast multi-device
  tests in one process), do it only when $JAX_NUM_CPU_DEVICES is unset: the
  launcher sets that variable to devices_per_process in workers, and the
  config option would override it.
- The parent pytest process never initializes `jax.distributed` for marked
  tests; unmarked tests run in the parent as usual. Fixtures of a marked test
  are set up in the workers, once per process.
- `hosts='netns'` runs each worker on a simulated host of its own
  (`multihost.netns`: a network namespace with its own address, the
  coordinator at host 0's address); without root and `ip` such tests are
  skipped with the reason.
- `multihost_tmp_path` is a fresh folder per test shared by all processes of
  a marked test (a plain `tmp_path` differs between processes); in unmarked
  tests it is `tmp_path`.

Tests that kill processes (failure drills) should not use the marker; start
controllers with `multihost.launch.Controllers` instead and send signals to
`cluster.pids`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import json
import os
import pathlib
import re
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

MARKER = 'multihost'
WORKER_ENV = env_lib.PYTEST_WORKER
BARRIER_TIMEOUT_ENV = env_lib.PYTEST_BARRIER_TIMEOUT
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
_OUTPUT_TAIL_LINES = 60
# Workers move in step, so after one crashes the others can only wait for it.
_GRACE_PERIOD_S = 2.0
_KV_ROOT = 'multihost-pytest'


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args) -> None:
  """In a worker, initializes jax.distributed before conftest.py files load."""
  del early_config, parser, args
  if os.environ.get(WORKER_ENV):
    import multihost
    multihost.initialize()


@pytest.hookimpl(tryfirst=True)  # Before tmp_path reads --basetemp.
def pytest_configure(config: pytest.Config) -> None:
  config.addinivalue_line(
      'markers',
      f'{MARKER}(num_processes=2, devices_per_process=1, timeout='
      f'{DEFAULT_TIMEOUT_S:g}, hosts=None): run the test body in num_processes real JAX '
      'controllers (multihost.testing).')
  results_dir = os.environ.get(WORKER_ENV)
  if results_dir:
    if config.option.basetemp is None:  # tmp_path: one tree per process.
      config.option.basetemp = os.path.join(
          results_dir, f'basetemp-p{os.environ.get(env_lib.PROCESS_ID, "0")}')
    config.pluginmanager.register(_Worker(config, results_dir),
                                  'multihost-worker')
  else:
    config.pluginmanager.register(_Parent(config), 'multihost-parent')


@pytest.fixture
def multihost_tmp_path(request: pytest.FixtureRequest,
                       tmp_path: pathlib.Path) -> pathlib.Path:
  """A fresh folder for this test, the same folder on every process."""
  worker = request.config.pluginmanager.get_plugin('multihost-worker')
  if worker is None:
    return tmp_path
  return worker.shared_path(request.node)


@dataclasses.dataclass(frozen=True)
class GroupSpec:
  """What a group of marked tests shares: one launch runs them all."""
  module: str
  num_processes: int
  devices_per_process: int
  timeout: float
  hosts: str | None = None


def marker_spec(item: pytest.Item) -> GroupSpec | None:
  """The test's group, or None when it is not marked.

  Raises:
    pytest.UsageError: the marker's arguments are invalid (named).
  """
  marker = item.get_closest_marker(MARKER)
  if marker is None:
    return None

  def spec(num_processes: int = 2, devices_per_process: int = 1,
           timeout: float = DEFAULT_TIMEOUT_S,
           hosts: str | None = None) -> GroupSpec:
    if hosts not in (None, 'netns'):
      raise ValueError(f"got hosts={hosts!r}; use None or 'netns'")
    if not (isinstance(num_processes, int) and num_processes >= 1 and
            isinstance(devices_per_process, int) and devices_per_process >= 1
            and timeout > 0):
      raise ValueError(
          f'got num_processes={num_processes!r}, devices_per_process='
          f'{devices_per_process!r}, timeout={timeout!r}')
    return GroupSpec(item.nodeid.split('::', 1)[0], num_processes,
                     devices_per_process, float(timeout), hosts)

  try:
    return spec(*marker.args, **marker.kwargs)
  except (TypeError, ValueError) as e:
    raise pytest.UsageError(
        f'{item.nodeid}: invalid @pytest.mark.{MARKER}(...): {e}. Use '
        f'@pytest.mark.{MARKER}(num_processes=2, devices_per_process=1, '
        'timeout=300) with positive integers and a positive timeout.'
    ) from None


# The parent: groups marked tests, launches workers, reports their results.

# Set by a worker on its serialized teardown report: the test passed on this
# process, which only reports that a peer failed.
_PEER_FAILURE = 'multihost_peer_failure'


class _Parent:
  """Runs marked tests' groups in workers and reports them one by one."""

  def __init__(self, config: pytest.Config):
    self._config = config
    self._groups: dict[GroupSpec, list[pytest.Item]] = {}
    # nodeid -> per process -> when -> the worker's report; filled as groups
    # run.
    self._records: dict[str, list[dict[str, pytest.TestReport]]] = {}
    self._launch_info: dict[GroupSpec, Any] = {}
    # Seconds of a group's launch not spent in its tests (process start,
    # jax.distributed, collection), charged to its first test's setup.
    self._overhead: dict[GroupSpec, float] = {}
    self.launches = 0

  def pytest_collection_finish(self, session: pytest.Session) -> None:
    self._groups.clear()
    for item in session.items:
      spec = marker_spec(item)
      if spec is not None:
        self._groups.setdefault(spec, []).append(item)

  @pytest.hookimpl(tryfirst=True)
  def pytest_runtest_protocol(self, item: pytest.Item,
                              nextitem: pytest.Item | None) -> bool | None:
    spec = marker_spec(item)
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
        reports[-1] = _report(item, 'teardown', 'failed',
                              traceback.format_exc())
    for report in reports:
      ihook.pytest_runtest_logreport(report=report)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True

  def _run_group(self, spec: GroupSpec, first: pytest.Item) -> None:
    """Runs every test of the group in one launch; stores their results."""
    from multihost import launch  # Not at import: keep plugin loading cheap.

    # Never an empty list: workers given no test would run the whole suite.
    items = self._groups.get(spec) or [first]
    config = self._config
    results_dir = tempfile.mkdtemp(prefix='multihost-pytest-')
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
    if config.pluginmanager.get_plugin('multihost') is not sys.modules[
        __name__] or os.environ.get(env_lib.PYTEST_DISABLE_PLUGIN_AUTOLOAD):
      command += ['-p', 'multihost.testing']
    command += [item.nodeid for item in items]
    env = {WORKER_ENV: results_dir,
           BARRIER_TIMEOUT_ENV: str(spec.timeout)}
    if not os.environ.get(env_lib.TIMEOUT):
      env[env_lib.TIMEOUT] = str(
          min(DEFAULT_COLLECTIVE_TIMEOUT_S, spec.timeout / 2))
    start = time.monotonic()
    try:
      # SIGINT/SIGTERM/SIGHUP to this pytest (Ctrl-C, `timeout`, a closed
      # terminal) first stop the workers, then act as they would have.
      result = launch.launch(
          command, num_processes=spec.num_processes,
          devices_per_process=spec.devices_per_process, timeout=spec.timeout,
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
        for data in _read_records(path):
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
               spec: GroupSpec) -> list[pytest.TestReport]:
    n = spec.num_processes
    per_process = self._records.get(item.nodeid, [{} for _ in range(n)])
    result = self._launch_info[spec]
    reports = []
    for when in ('setup', 'call', 'teardown'):
      records = [p.get(when) for p in per_process]
      if any(r is None for r in records):
        reports.append(self._incomplete(item, spec, per_process, result,
                                        when=when))
        break
      reports.append(_combine(item, spec, when, records))
      if when == 'setup' and reports[-1].outcome != 'passed':
        break  # Like pytest: no call phase after a failed or skipped setup.
    if reports[-1].when != 'teardown':
      reports.append(_report(item, 'teardown', 'passed', None))
    group = self._groups.get(spec, [])
    if group and group[0] is item:  # Shows the launch cost in --durations.
      reports[0].duration += self._overhead.get(spec, 0.0)
    return reports

  def _incomplete(self, item: pytest.Item, spec: GroupSpec,
                  per_process: list[dict[str, pytest.TestReport]],
                  result: Any,
                  when: str = 'call') -> pytest.TestReport:
    """A failure report for a test that did not complete on every process."""
    n = spec.num_processes
    missing = [i for i in range(n) if per_process[i].get('teardown') is None]
    started = [i for i in range(n) if per_process[i].get('setup') is not None]
    if result.timed_out:
      why = (f'the group of {item.nodeid.split("::")[0]} '
             f'(num_processes={n}, devices_per_process='
             f'{spec.devices_per_process}) hit its timeout of '
             f'{spec.timeout:g} s and was stopped. Pass a larger '
             f'@pytest.mark.{MARKER}(..., timeout=...) if it needs longer, '
             'or look for a process waiting in a collective a peer did not '
             'call')
    elif result.first_failure is not None:
      from multihost import launch
      first = result.first_failure
      why = (f'the workers stopped early: process {first} ended first, '
             f'{launch.describe(result.returncodes[first])}')
    else:
      why = 'the worker processes stopped early'
    lines = [f'multihost: this test did not complete on processes {missing} '
             f'of {n}: {why}.']
    group_started = any(self._records.get(other.nodeid)
                        for other in self._groups.get(spec, []))
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
        tail = out.splitlines()[-_OUTPUT_TAIL_LINES:]
        sections.append((f'Output of process {i} (last {len(tail)} lines)',
                         '\n'.join(f'[p{i}] {line}' for line in tail)))
    return _report(item, when, 'failed', '\n'.join(lines), sections=sections)


def _read_records(path: str) -> list[dict[str, Any]]:
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


def _report(item: pytest.Item, when: str, outcome: str, longrepr: Any, *,
            sections=(), duration: float = 0.0,
            wasxfail: str | None = None) -> pytest.TestReport:
  extra = {} if wasxfail is None else {'wasxfail': wasxfail}
  return pytest.TestReport(
      item.nodeid, item.location, {k: 1 for k in item.keywords}, outcome,
      longrepr, when, sections=list(sections), duration=duration,
      user_properties=list(item.user_properties), **extra)


class _ProcessesRepr:
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


def _combine(item: pytest.Item, spec: GroupSpec, when: str,
             records: list[pytest.TestReport]) -> pytest.TestReport:
  """One report from every process's report of the same phase."""
  n = spec.num_processes
  # A process that passed but was told a peer failed does not count twice.
  outcomes = ['passed' if getattr(r, _PEER_FAILURE, False) else r.outcome
              for r in records]
  duration = max(r.duration for r in records)
  sections = [(f'{title} [p{i}]', _prefix(i, text) + '\n')
              for i, r in enumerate(records) for title, text in r.sections]
  if 'failed' in outcomes:
    failing = [i for i, o in enumerate(outcomes) if o == 'failed']
    return _report(
        item, when, 'failed', _ProcessesRepr(
            f'multihost: {when} failed on process(es) {failing} of {n} '
            f'(devices_per_process={spec.devices_per_process}).',
            [(i, records[i].longrepr) for i in failing]),
        sections=sections, duration=duration)
  if all(o == 'skipped' for o in outcomes):
    first = records[0]
    longrepr = first.longrepr
    if isinstance(longrepr, list):  # (path, lineno, reason), through JSON.
      longrepr = tuple(longrepr)
    return _report(item, when, 'skipped', longrepr, sections=sections,
                   duration=duration,
                   wasxfail=getattr(first, 'wasxfail', None))
  if all(o == 'passed' for o in outcomes):
    return _report(item, when, 'passed', None, sections=sections,
                   duration=duration)
  skipped = [i for i, o in enumerate(outcomes) if o == 'skipped']
  passed = [i for i, o in enumerate(outcomes) if o == 'passed']
  reasons = '; '.join(f'p{i}: {_skip_reason(records[i])}' for i in skipped)
  return _report(
      item, when, 'failed',
      f'multihost: {when} was skipped on process(es) {skipped} ({reasons}) '
      f'but passed on {passed}. Every process must make the same skip '
      'decision; skip before the test runs (a marker) or on every process.',
      sections=sections, duration=duration)


def _prefix(index: int, text: str) -> str:
  return '\n'.join(f'[p{index}] {line}' for line in text.splitlines())


# The worker: one pytest session per process, in step with its peers.


def _exit_when_orphaned(parent_pid: int, results_dir: str) -> None:
  """Ends this worker when the pytest that launched it is gone.

  The parent stops its workers itself when it can; this covers a parent
  killed outright (SIGKILL), which would otherwise leave workers waiting at
  a barrier for up to the group's timeout.
  """
  while os.getppid() == parent_pid:
    time.sleep(0.5)
  try:  # Usually nobody reads this any more: the pipe's reader is gone.
    sys.__stderr__.write(
        f'[multihost.testing] the parent pytest (pid {parent_pid}) is gone; '
        'this worker exits.\n')
    sys.__stderr__.flush()
  except (OSError, ValueError):
    pass
  finally:
    shutil.rmtree(results_dir, ignore_errors=True)  # The parent cannot.
    os._exit(3)


class _Worker:
  """Runs in each worker pytest session: initialize, barriers, results."""

  def __init__(self, config: pytest.Config, results_dir: str):
    import multihost  # Usually already initialized, before conftest.py.

    self._config = config
    self._dir = pathlib.Path(results_dir)
    self._index = int(os.environ.get(env_lib.PROCESS_ID, '0'))
    self._timeout = float(os.environ.get(BARRIER_TIMEOUT_ENV,
                                         DEFAULT_TIMEOUT_S))
    self._out = open(self._dir / f'p{self._index}.jsonl', 'a',
                     encoding='utf-8')
    self._seq = -1
    self._failed = False
    self._start_error: BaseException | None = None
    self._peer_failed: set[str] = set()
    multihost.initialize()
    threading.Thread(target=_exit_when_orphaned,
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
    from multihost import _control_rendezvous, _coordination, _process

    count = _process.process_count()
    if count == 1:
      return [payload]
    prefix = f'{_KV_ROOT}/{self._seq}/{phase}/'
    # JSON, not pickle: reading a value written by anyone who can reach the
    # coordination service must not run code.
    _coordination.kv_set(prefix + str(self._index),
                         json.dumps(payload).encode())
    _control_rendezvous.barrier(prefix, f'pytest {phase} barrier',
                                timeout=self._timeout)
    messages: list[Any] = [None] * count
    for key, value in _coordination.kv_dir(prefix):
      messages[int(key.rsplit('/', 1)[1])] = json.loads(value)
    return messages

  @pytest.hookimpl(tryfirst=True)
  def pytest_runtest_protocol(self, item: pytest.Item, nextitem) -> None:
    """Enters the test through a barrier that checks all run the same test."""
    del nextitem
    from multihost import _calls

    self._seq += 1
    # Marks the test in the process's output, for crash and hang reports.
    sys.__stderr__.write(f'\n[multihost.testing] start {item.nodeid}\n')
    sys.__stderr__.flush()
    self._failed = False
    self._start_error = None
    try:
      # Each process's next collective number: all restart from the largest,
      # so collectives stay matched even after a test left some unmatched.
      mine = (item.nodeid, _calls.next_call_id())
      everyone = self._exchange('start', mine)
      ids = [m[0] for m in everyone]
      if len(set(ids)) != 1:
        raise RuntimeError(
            f'[process={self._index}] the worker processes are not running '
            f'the same test: {dict(enumerate(ids))}. This is a bug in '
            'multihost.testing; please report it.')
      _calls.reset(max(m[1] for m in everyone) + 1)
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
    data[_PEER_FAILURE] = (report.when == 'teardown' and
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
