"""multihost/env.py, loaded by itself: the launcher's variable names without JAX.

`from multihost import env` runs the package's __init__, which imports JAX
(over a CPU-second per process); these programs only read the variables the
launcher sets.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

_PACKAGE = importlib.util.find_spec('multihost')  # Locates; runs nothing.
assert _PACKAGE is not None and _PACKAGE.origin, 'multihost is not installed'
_SPEC = importlib.util.spec_from_file_location(
    'multihost_env_alone', pathlib.Path(_PACKAGE.origin).parent / 'env.py')
env_lib = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = env_lib
_SPEC.loader.exec_module(env_lib)
