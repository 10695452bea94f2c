"""Test setup: CPU only, and 4 virtual devices for single-process tests.

Worker processes of `@pytest.mark.multihost` tests get their device count
from the launcher (JAX_NUM_CPU_DEVICES); the parent pytest process, which
runs the unmarked tests as one controller, gets 4 devices here. (The
multihost pytest plugin has already imported jax by now, so the environment
variable would come too late; the config option still works, as long as no
backend has started.)

Ctrl-C reaches the processes the tests start: a shell that starts pytest in
the background without job control leaves SIGINT ignored, and an ignored
signal stays ignored in every child, so a test of a controller's Ctrl-C
would wait on a process that never sees it. Handling SIGINT here (Python's
own handler) makes children start with the default again.
"""

import os
import signal

import jax

from multihost import env as env_lib

os.environ.setdefault(env_lib.PLATFORMS, 'cpu')
if env_lib.NUM_CPU_DEVICES not in os.environ:
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', 4)

# The pytest process that owns this session (xdist's workers inherit it):
# a real Slurm started for the tests (tests/slurm_cluster.py) lives as long
# as that process.
os.environ.setdefault('MULTIHOST_TEST_SESSION_PID', str(os.getpid()))

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
  signal.signal(signal.SIGINT, signal.default_int_handler)
