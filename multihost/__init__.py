"""multihost: collectives that multi-controller JAX runs need to agree.

A drop-in replacement for `jax.experimental.multihost_utils` built on public
JAX APIs, plus timeouts that name missing processes, agreement checks instead
of aborts, digest comparisons and object collectives.

Layers, top to bottom. A call goes down only, never back up: no module
imports one above it (public modules may use one another), and there is no
import cycle (tests/test_layers.py checks both). Modules _*.py are private.

  public              _broadcast, _gather, _sync (sync_global_devices), _equal,
                      _digest, _arrays, _preemption, _watched, _stragglers,
                      _live_devices (JAX's fault-tolerance block, on the
                      watchdog and barriers of the live processes);
                      _initialize
  control plane       _control_agree: agreement on what every process is about
                        to do (Header; agree, agree_and_read_one,
                        agree_and_gather, full_exchange)
                      -> _control_rendezvous: barriers and key-value messages
                        through the coordination service; _calls numbers them
  where               _where: each process's daemon thread that reports its
                        stacks and last collectives (on request, on SIGUSR1,
                        in timeouts and stall reports)
                      -> _flight: the ring of this process's last collectives
  data plane          _data_plane: the $MULTIHOST_TRANSPORT switch
                      -> _data_tcp (TCP between hosts) | _data_device (device
                        collectives)
  failure             _watchdog: sees a peer die; runs blocking steps watched
  diagnostics         _diagnostics: the `[process=N]` prefix, shortening, the
                        advice, and low-level failures as named errors
                      _companion: the coordination service in a companion
                        process of process 0 (opt-in)
  coordination        _coordination: the one module that touches JAX's
                        coordination-service client (used by the rendezvous,
                        the TCP plane's address book and the watchdog)
  runtime facts       _process: process index and count, default timeout
  pure                _leaves (pytree leaves <-> host bytes), _errors, env
                        (every environment variable name)
  semi-public         lowlevel: the seams tools and tests use
"""

from multihost._arrays import (
    global_array_to_host_local_array as global_array_to_host_local_array,
    host_local_array_to_global_array as host_local_array_to_global_array,
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
from multihost._live_devices import (
    live_devices as live_devices,
)
from multihost._preemption import (
    reached_preemption_sync_point as reached_preemption_sync_point,
)
from multihost._initialize import (
    initialize as initialize,
)
from multihost._process import (
    default_timeout as default_timeout,
    set_default_timeout as set_default_timeout,
)
from multihost._sync import (
    sync_global_devices as sync_global_devices,
)
from multihost._watched import (
    call_watched as call_watched,
)
from multihost._stragglers import (
    StragglerReport as StragglerReport,
    straggler_report as straggler_report,
)
from multihost._where import (
    set_stall_report_after as set_stall_report_after,
    stall_report_after as stall_report_after,
    where as where,
)

from multihost import env as env
from multihost import lowlevel as lowlevel

__version__ = '0.1.0'
