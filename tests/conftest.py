"""Test setup: CPU only, and 4 virtual devices for single-process tests.

Worker processes of `@pytest.mark.multihost` tests get their device count
from the launcher (JAX_NUM_CPU_DEVICES); the parent pytest process, which
runs the unmarked tests as one controller, gets 4 devices here.
"""

import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('JAX_NUM_CPU_DEVICES', '4')
