"""Runs N JAX controllers on this machine: `python -m multihost.launch`.

Usage:

  python -m multihost.launch --num_processes=2 --devices_per_process=2 \\
      [--timeout=SECONDS] [--grace_period=SECONDS] [--max_restarts=N] \\
      [--compilation_cache_dir=DIR] [--host_service] [--hosts=netns] \\
      [--trace=PATH] -- python train.py --flag

Each controller gets an environment in which both `multihost.initialize()`
and a bare `jax.distributed.initialize()` work unchanged (see `child_env`):
a free loopback coordinator port, `JAX_NUM_CPU_DEVICES=K` CPU devices, and an
Open MPI-like environment that JAX auto-detects. Every output line is
streamed with its process index (`[p1] ...`). The first failure stops the
run: after a grace period the launcher stops the others (SIGTERM, then
SIGKILL) and exits with the first failing process's status (128+signal for a
signal); a summary says who failed first (by when it raised or exited,
whichever came first), how, and what the others were doing then. With
`--max_restarts=N` a failed run starts all controllers again, up to N
times, each with `MULTIHOST_RESTART_COUNT` set to its attempt (0, 1, ...),
as torchrun does; the summary lists every attempt. While restarts are left
the first failure stops the others at once (no grace period), and a
controller that exits with status 78 (`multihost.env.NO_RETRY_EXIT_STATUS`:
restarting will not help) ends the run after its attempt. Every attempt
gets the same JAX persistent compilation cache folder
(`--compilation_cache_dir`, else $JAX_COMPILATION_CACHE_DIR if set, else a
temporary one). When process 0, which hosts JAX's coordination service,
dies first, the summary says so and does not blame the survivors that the
JAX runtime then aborted. `--timeout`
bounds the whole run (exit status 124). SIGINT/SIGTERM/SIGHUP to the
launcher are forwarded to the controllers, which are then killed; nothing is
left running. `--trace=PATH` writes the run's timeline (see
`_src/run/trace.py`).

The same machinery is a library, for tests and the pytest plugin:

  result = launch.launch(['python', 'script.py'], num_processes=2,
                         devices_per_process=2, timeout=60)
  assert result.ok, result.summary

  with launch.Controllers(cmd, num_processes=3) as cluster:
    cluster.wait_for_output(1, 'ready', timeout=30)
    cluster.kill(0, signal.SIGKILL)
    result = cluster.wait(timeout=30)

The implementation is in _src/, in packages top to bottom (LAYERS in
_src/__init__.py; a package imports only those below it), one job a module:
  run/          one run of N controllers
    cli.py          the one command line (`main`), also behind bin/launch.py
    run.py          `launch()`: Controllers to the end, signals, summary
    controllers.py  `Controllers` (context manager): composes the parts
                    below and the attempts
    resources.py    what a run holds from start to stop: simulated hosts,
                    port, compilation cache folder, the hosted service
    attempt.py      one attempt's steps: environments, supervision, its
                    result, its log files when it is restarted
    trace.py        `--trace`: the controllers' flight-recorder dumps
                    merged into one timeline, the summary's divergence line
  policy/       the run policy
    policy.py       first failure + grace period (or at once when a restart
                    follows), timeout, SIGTERM then SIGKILL, restarts,
                    status 78 (`next_step`, `after_attempt`,
                    `not_retryable` are pure)
    restarts.py     pure: the run's result from its attempts' results
  processes/    the controller processes
    environment.py  each controller's port, environment, host, `ps` label
    processes.py    spawn N processes in their own sessions, reap, signal,
                    stop
    reaper.py       nothing outlives the launcher (parent-death signal,
                    subreaper)
    output.py       capture their output, with when each line was read;
                    stream it live with `[pN] ` prefixes
    signals.py      SIGINT/SIGTERM/SIGHUP to the launcher -> a stop request
  report/       how a run ended, pure
    evidence.py     what a process's output says (its first traceback, its
                    last line by then, the peers it named as failed)
    observed.py     what the launcher saw of a finished run (`Observed`),
                    and how a process ended, in words
    summary.py      the run's account, one line per process, then who
                    failed first, how, and where the others were
    report.py       who failed first (by raise or exit; process-0 blame),
                    exit status, summary -> `LaunchResult`
"""

from __future__ import annotations

from multihost.launch._src.policy.policy import (
    DEFAULT_GRACE_PERIOD_S as DEFAULT_GRACE_PERIOD_S,
)
from multihost.launch._src.policy.policy import (
    DEFAULT_KILL_WAIT_S as DEFAULT_KILL_WAIT_S,
)
from multihost.launch._src.processes.environment import child_env as child_env
from multihost.launch._src.processes.environment import (
    find_free_port as find_free_port,
)
from multihost.launch._src.processes.environment import (
    hold_free_port as hold_free_port,
)
from multihost.launch._src.report.evidence import (
    LOST_SERVICE_MARKER as LOST_SERVICE_MARKER,
)
from multihost.launch._src.report.evidence import (
    lost_coordinator as lost_coordinator,
)
from multihost.launch._src.report.observed import Observed as Observed
from multihost.launch._src.report.observed import describe as describe
from multihost.launch._src.report.observed import signal_name as signal_name
from multihost.launch._src.report.observed import status_of as status_of
from multihost.launch._src.report.report import (
    TIMEOUT_EXIT_STATUS as TIMEOUT_EXIT_STATUS,
)
from multihost.launch._src.report.report import LaunchResult as LaunchResult
from multihost.launch._src.report.report import report as report
from multihost.launch._src.run.cli import main as main
from multihost.launch._src.run.cli import parser as parser
from multihost.launch._src.run.cli import run_cli as run_cli
from multihost.launch._src.run.cli import split_command as split_command
from multihost.launch._src.run.controllers import (
    DEFAULT_HEARTBEAT_S as DEFAULT_HEARTBEAT_S,
)
from multihost.launch._src.run.controllers import Controllers as Controllers
from multihost.launch._src.run.run import launch as launch
