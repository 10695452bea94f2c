"""Test setup: CPU only, and 4 virtual devices for single-process tests.

Worker processes of `@pytest.mark.multihost` tests get their device count
from the launcher (JAX_NUM_CPU_DEVICES); the parent pytest process, which
runs the unmarked tests as one controller, gets 4 devices here. (The
multihost pytest plugin has already imported jax by now, so the environment
variable would come too late; the config option still works, as long as no
backend has started.)
"""

import os

import jax

from multihost import env as env_lib

os.environ.setdefault(env_lib.PLATFORMS, 'cpu')
if env_lib.NUM_CPU_DEVICES not in os.environ:
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', 4)
