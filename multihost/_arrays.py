"""Host-local <-> global jax.Array conversion (temporary: delegates to JAX)."""
from jax.experimental.multihost_utils import (  # noqa: F401
    global_array_to_host_local_array, host_local_array_to_global_array)
