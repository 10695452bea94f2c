"""multihost: collectives that multi-controller JAX runs need to agree.

A drop-in replacement for `jax.experimental.multihost_utils` built on public
JAX APIs, plus timeouts that name missing processes, agreement checks instead
of aborts, digest comparisons and object collectives.

The implementation lives in private packages under `multihost/_src/` (see
its `__init__.py`: the packages, top to bottom, and the one rule that
imports run one way between them); this module only re-exports. The public
submodules are `env` (environment variable names), `files` (the atomic
file writer), `lowlevel` (seams for tools and tests), `netns` (simulated
hosts), `launch` (the local launcher) and `testing` (the pytest plugin).
"""

# Public names load on first use (PEP 562), so that a process that only
# needs the launcher, `multihost.env` or `multihost.netns` (e.g.
# `python -m multihost.launch`) does not import JAX. Static tools read the
# imports under TYPE_CHECKING below; tests/unit/test_init.py checks that they and
# `_PUBLIC` name the same things.
import importlib
import typing

_SUBMODULES = ('env', 'files', 'lowlevel')
_PUBLIC = {
    '_src.api.arrays': ('global_array_to_host_local_array',
                        'host_local_array_to_global_array'),
    '_src.api.broadcast': ('broadcast_object', 'broadcast_one_to_all'),
    '_src.api.digest': ('leaf_digests', 'tree_digest'),
    '_src.api.equal': ('assert_equal',),
    '_src.api.exchange': ('exchange',),
    '_src.api.gather': ('allgather_object', 'process_allgather'),
    '_src.api.initialize': ('initialize', 'is_initialized'),
    '_src.api.live_devices': ('live_devices',),
    '_src.api.objects': ('max_object_bytes',),
    '_src.api.preemption': ('reached_preemption_sync_point',),
    '_src.api.stragglers': ('StragglerReport', 'straggler_report'),
    '_src.api.sync': ('sync_global_devices',),
    '_src.api.trace': ('write_trace',),
    '_src.api.watched': ('call_watched',),
    '_src.diagnostics.metrics': ('record_event',),
    '_src.diagnostics.stalls': ('set_stall_report_after',
                                'stall_report_after'),
    '_src.diagnostics.where': ('where',),
    '_src.liveness.step_api': ('set_step_deadline', 'step_watch'),
    '_src.liveness.watchdog': ('set_exit_on_peer_failure',),
    '_src.runtime.errors': ('CollectiveTimeoutError', 'ConsistencyError',
                            'MultihostError', 'NotInitializedError',
                            'ProcessFailureError'),
    '_src.runtime.process': ('default_timeout', 'process_prefix',
                             'set_default_timeout'),
}
_WHERE = {name: module for module, names in _PUBLIC.items()
          for name in names}
__all__ = sorted([*_SUBMODULES, *_WHERE])
__version__ = '0.1.0'


def __getattr__(name: str):
  if name in _SUBMODULES:
    value = importlib.import_module(f'multihost.{name}')
  elif name in _WHERE:
    importlib.import_module('multihost._src.api')  # Assembles runtimes.
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
  from multihost import files as files
  from multihost import lowlevel as lowlevel
  from multihost._src.api.arrays import (
    global_array_to_host_local_array as global_array_to_host_local_array,
  )
  from multihost._src.api.arrays import (
    host_local_array_to_global_array as host_local_array_to_global_array,
  )
  from multihost._src.api.broadcast import broadcast_object as broadcast_object
  from multihost._src.api.broadcast import (
    broadcast_one_to_all as broadcast_one_to_all,
  )
  from multihost._src.api.digest import leaf_digests as leaf_digests
  from multihost._src.api.digest import tree_digest as tree_digest
  from multihost._src.api.equal import assert_equal as assert_equal
  from multihost._src.api.exchange import exchange as exchange
  from multihost._src.api.gather import allgather_object as allgather_object
  from multihost._src.api.gather import process_allgather as process_allgather
  from multihost._src.api.initialize import initialize as initialize
  from multihost._src.api.initialize import is_initialized as is_initialized
  from multihost._src.api.live_devices import live_devices as live_devices
  from multihost._src.api.objects import max_object_bytes as max_object_bytes
  from multihost._src.api.preemption import (
    reached_preemption_sync_point as reached_preemption_sync_point,
  )
  from multihost._src.api.stragglers import StragglerReport as StragglerReport
  from multihost._src.api.stragglers import straggler_report as straggler_report
  from multihost._src.api.sync import sync_global_devices as sync_global_devices
  from multihost._src.api.trace import write_trace as write_trace
  from multihost._src.api.watched import call_watched as call_watched
  from multihost._src.diagnostics.metrics import record_event as record_event
  from multihost._src.diagnostics.stalls import (
    set_stall_report_after as set_stall_report_after,
  )
  from multihost._src.diagnostics.stalls import (
    stall_report_after as stall_report_after,
  )
  from multihost._src.diagnostics.where import where as where
  from multihost._src.liveness.step_api import (
    set_step_deadline as set_step_deadline,
  )
  from multihost._src.liveness.step_api import step_watch as step_watch
  from multihost._src.liveness.watchdog import (
    set_exit_on_peer_failure as set_exit_on_peer_failure,
  )
  from multihost._src.runtime.errors import (
    CollectiveTimeoutError as CollectiveTimeoutError,
  )
  from multihost._src.runtime.errors import ConsistencyError as ConsistencyError
  from multihost._src.runtime.errors import MultihostError as MultihostError
  from multihost._src.runtime.errors import (
    NotInitializedError as NotInitializedError,
  )
  from multihost._src.runtime.errors import (
    ProcessFailureError as ProcessFailureError,
  )
  from multihost._src.runtime.process import default_timeout as default_timeout
  from multihost._src.runtime.process import process_prefix as process_prefix
  from multihost._src.runtime.process import (
    set_default_timeout as set_default_timeout,
  )
