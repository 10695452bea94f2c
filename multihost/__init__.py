"""multihost: collectives that multi-controller JAX runs need to agree.

A drop-in replacement for `jax.experimental.multihost_utils` built on public
JAX APIs, plus timeouts that name missing processes, agreement checks instead
of aborts, digest comparisons and object collectives.

Layers, top to bottom. A call goes down only, never back up: a module
imports only modules of its own layer or below (public modules may use one
another), and there is no import cycle. tests/test_layers.py reads this map
(one layer a line, `layer: modules`; a line without a colon continues the
layer above) and README's Layout lists the same modules, one job each.
Modules _*.py are private.

  semi-public: __init__ lowlevel testing launch netns
  public: _broadcast _gather _sync _equal _digest _arrays _preemption
    _watched _stragglers _initialize _live_devices _trace
  live barrier: _live_barrier
  payloads: _objects _data_plane
  agreement: _control_agree
  codec: _control_codec
  rendezvous: _control_rendezvous
  agreement over the links: _control_links
  diagnosis marks: _control_marks
  stall reports: _stalls
  where-responder: _where
  where rendering, SIGUSR1: _where_text _where_signal
  data transports: _data_tcp _data_device
  tcp links: _tcp_link
  tcp credentials, frames: _tcp_auth _tcp_frames
  tcp socket I/O, errors, job secret: _tcp_io _tcp_errors _secret
  watched calls: _blocking
  liveness: _watchdog
  exit handshake: _exit
  leaving after a peer failure: _peer_loss_exit
  diagnostics, companion: _diagnostics _companion
  recording, metrics: _metrics
  runtime facades: _calls _process
  runtime: _runtime
  coordination client: _coordination
  pure: _leaves _errors env _flight _trace_format _buffers
"""

# Public names load on first use (PEP 562), so that a process that only
# needs the launcher, `multihost.env` or `multihost.netns` (e.g.
# `python -m multihost.launch`) does not import JAX. Static tools read the
# imports under TYPE_CHECKING below; tests/test_init.py checks that they and
# `_PUBLIC` name the same things.
import importlib
import typing

_SUBMODULES = ('env', 'lowlevel')
_PUBLIC = {
    '_arrays': ('global_array_to_host_local_array',
                'host_local_array_to_global_array'),
    '_broadcast': ('broadcast_object', 'broadcast_one_to_all'),
    '_digest': ('leaf_digests', 'tree_digest'),
    '_equal': ('assert_equal',),
    '_errors': ('CollectiveTimeoutError', 'ConsistencyError',
                'MultihostError', 'NotInitializedError',
                'ProcessFailureError'),
    '_gather': ('allgather_object', 'process_allgather'),
    '_initialize': ('initialize', 'is_initialized'),
    '_live_devices': ('live_devices',),
    '_metrics': ('record_event',),
    '_preemption': ('reached_preemption_sync_point',),
    '_process': ('default_timeout', 'set_default_timeout'),
    '_stalls': ('set_stall_report_after', 'stall_report_after'),
    '_stragglers': ('StragglerReport', 'straggler_report'),
    '_sync': ('sync_global_devices',),
    '_trace': ('write_trace',),
    '_watchdog': ('set_exit_on_peer_failure',),
    '_watched': ('call_watched',),
    '_where': ('where',),
}
_WHERE = {name: module for module, names in _PUBLIC.items()
          for name in names}
__all__ = sorted([*_SUBMODULES, *_WHERE])
__version__ = '0.1.0'


def __getattr__(name: str):
  if name in _SUBMODULES:
    value = importlib.import_module(f'multihost.{name}')
  elif name in _WHERE:
    value = getattr(importlib.import_module(f'multihost.{_WHERE[name]}'),
                    name)
  else:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  globals()[name] = value  # Later uses find it without this function.
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *__all__})


if typing.TYPE_CHECKING:
  from multihost import env as env
  from multihost import lowlevel as lowlevel
  from multihost._arrays import (
      global_array_to_host_local_array as global_array_to_host_local_array,
  )
  from multihost._arrays import (
      host_local_array_to_global_array as host_local_array_to_global_array,
  )
  from multihost._broadcast import broadcast_object as broadcast_object
  from multihost._broadcast import broadcast_one_to_all as broadcast_one_to_all
  from multihost._digest import leaf_digests as leaf_digests
  from multihost._digest import tree_digest as tree_digest
  from multihost._equal import assert_equal as assert_equal
  from multihost._errors import CollectiveTimeoutError as CollectiveTimeoutError
  from multihost._errors import ConsistencyError as ConsistencyError
  from multihost._errors import MultihostError as MultihostError
  from multihost._errors import NotInitializedError as NotInitializedError
  from multihost._errors import ProcessFailureError as ProcessFailureError
  from multihost._gather import allgather_object as allgather_object
  from multihost._gather import process_allgather as process_allgather
  from multihost._initialize import initialize as initialize
  from multihost._initialize import is_initialized as is_initialized
  from multihost._live_devices import live_devices as live_devices
  from multihost._metrics import record_event as record_event
  from multihost._preemption import (
      reached_preemption_sync_point as reached_preemption_sync_point,
  )
  from multihost._process import default_timeout as default_timeout
  from multihost._process import set_default_timeout as set_default_timeout
  from multihost._stalls import set_stall_report_after as set_stall_report_after
  from multihost._stalls import stall_report_after as stall_report_after
  from multihost._stragglers import StragglerReport as StragglerReport
  from multihost._stragglers import straggler_report as straggler_report
  from multihost._sync import sync_global_devices as sync_global_devices
  from multihost._trace import write_trace as write_trace
  from multihost._watchdog import (
      set_exit_on_peer_failure as set_exit_on_peer_failure,
  )
  from multihost._watched import call_watched as call_watched
  from multihost._where import where as where
