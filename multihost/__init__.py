"""multihost: collectives that multi-controller JAX runs need to agree.

A drop-in replacement for `jax.experimental.multihost_utils` built on public
JAX APIs, plus timeouts that name missing processes, agreement checks instead
of aborts, digest comparisons and object collectives.
"""

from multihost._arrays import (
    global_array_to_host_local_array as global_array_to_host_local_array,
    host_local_array_to_global_array as host_local_array_to_global_array,
)
from multihost._barrier import (
    sync_global_devices as sync_global_devices,
)
from multihost._broadcast import (
    broadcast_object as broadcast_object,
    broadcast_one_to_all as broadcast_one_to_all,
)
from multihost._digest import (
    leaf_digests as leaf_digests,
    tree_digest as tree_digest,
)
from multihost._equal import (
    assert_equal as assert_equal,
)
from multihost._errors import (
    CollectiveTimeoutError as CollectiveTimeoutError,
    ConsistencyError as ConsistencyError,
    MultihostError as MultihostError,
    NotInitializedError as NotInitializedError,
    ProcessFailureError as ProcessFailureError,
)
from multihost._gather import (
    allgather_object as allgather_object,
    process_allgather as process_allgather,
)
from multihost._preemption import (
    reached_preemption_sync_point as reached_preemption_sync_point,
)
from multihost._runtime import (
    default_timeout as default_timeout,
    initialize as initialize,
    set_default_timeout as set_default_timeout,
)
from multihost._watched import (
    call_watched as call_watched,
)

from multihost import env as env
from multihost import lowlevel as lowlevel

__version__ = '0.1.0'
