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

Modules (one job each): this one holds the hooks pytest loads and the
fixture; `_marker` the marker and its groups; `_parent` the parent side
(group, launch, report); `_merge` the pure merging of N processes' reports
into one; `_worker` the worker sessions.
"""

from __future__ import annotations

import os
import pathlib

import pytest

from multihost import env as env_lib
from multihost.testing import _marker
from multihost.testing._marker import BARRIER_TIMEOUT_ENV as BARRIER_TIMEOUT_ENV
from multihost.testing._marker import (
  DEFAULT_COLLECTIVE_TIMEOUT_S as DEFAULT_COLLECTIVE_TIMEOUT_S,
)
from multihost.testing._marker import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from multihost.testing._marker import MARKER as MARKER
from multihost.testing._marker import WORKER_ENV as WORKER_ENV
from multihost.testing._marker import GroupSpec as GroupSpec
from multihost.testing._marker import marker_spec as marker_spec


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args) -> None:
  """In a worker, initializes jax.distributed before conftest.py files load."""
  del early_config, parser, args
  if os.environ.get(WORKER_ENV):
    import multihost
    multihost.initialize()


@pytest.hookimpl(tryfirst=True)  # Before tmp_path reads --basetemp.
def pytest_configure(config: pytest.Config) -> None:
  """Declares the marker; registers the worker session in a worker, the parent session elsewhere."""
  config.addinivalue_line(
      'markers',
      f'{MARKER}(num_processes=2, devices_per_process=1, timeout='
      f'{DEFAULT_TIMEOUT_S:g}, hosts=None): run the test body in '
      'num_processes real JAX controllers (multihost.testing).')
  results_dir = os.environ.get(WORKER_ENV)
  if results_dir:
    from multihost.testing import _worker  # pylint: disable=g-import-not-at-top
    if config.option.basetemp is None:  # tmp_path: one tree per process.
      config.option.basetemp = os.path.join(
          results_dir, f'basetemp-p{os.environ.get(env_lib.PROCESS_ID, "0")}')
    config.pluginmanager.register(_worker.WorkerSession(config, results_dir),
                                  _marker.WORKER_PLUGIN)
  else:
    from multihost.testing import _parent  # pylint: disable=g-import-not-at-top
    config.pluginmanager.register(_parent.ParentSession(config),
                                  _marker.PARENT_PLUGIN)


@pytest.fixture
def multihost_tmp_path(request: pytest.FixtureRequest,
                       tmp_path: pathlib.Path) -> pathlib.Path:
  """A fresh folder for this test, the same folder on every process."""
  worker = request.config.pluginmanager.get_plugin(_marker.WORKER_PLUGIN)
  if worker is None:
    return tmp_path
  return worker.shared_path(request.node)
