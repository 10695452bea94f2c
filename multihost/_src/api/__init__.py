"""The public functions, one module per family: each checks its input, agrees through `control`, and moves data through `transport`."""

# Registers the builder of every runtime's parts before any runtime is made.
from multihost._src.api import assembly as _assembly  # noqa: F401,E402
