"""Seams below the collectives, for tools and tests: the raw coordination barrier and key-value store, service hosting, the failure-detection bound, transport choice, the TCP links' socket options, JAX's C++ log threshold.

Who may import it: the launcher, `bin/bench.py`, `bench/` and the tests,
for what they measure or drive below the collectives; `recovery` only for
the names in `FOR_RECOVERY` (its quiet binaries hide JAX's C++ warnings
the way `multihost.initialize()` does; tests/unit/test_layers.py holds
it). Training code should not need it: what a program needs is public API
of `multihost` (e.g. `multihost.process_prefix`, `multihost.files`). These
seams are not part of the `jax.experimental.multihost_utils` surface and
carry no compatibility promise. Nothing outside `multihost/` imports a
private `multihost._*` module: it goes through here.
"""

from __future__ import annotations

import multihost._src.api  # noqa: F401  Assembles the runtimes this uses.
from multihost._src.liveness import watchdog
from multihost._src.runtime import companion
from multihost._src.runtime import coordination
from multihost._src.transport import choice
from multihost._src.transport.tcp import sockets

# The names `recovery` may import from here (see above).
FOR_RECOVERY = ('cpp_warnings_hidden',)


def wait_at_barrier(barrier_id: str, timeout: float) -> None:
  """Waits at a raw coordination-service barrier (no agreement, no watchdog).

  Collective: every process must call this with the same `barrier_id`.
  """
  coordination.wait_at_barrier(barrier_id, timeout)


def start_service(address: str, num_processes: int, *,
                  heartbeat_timeout: int, shutdown_timeout: int = 300):
  """Hosts a recoverable coordination service in this process; `.shutdown()` it after use.

  The controllers must then run with `MULTIHOST_EXTERNAL_SERVICE=1` (see
  `multihost.env.external_service_env`) and call `multihost.initialize()`.
  """
  return coordination.start_service(
      address, num_processes, heartbeat_timeout=heartbeat_timeout,
      shutdown_timeout=shutdown_timeout)


def failure_detection_bound() -> float:
  """Seconds within which the watchdog reports a peer that was killed."""
  return watchdog.detection_bound()


def tcp_transport_enabled() -> bool:
  """Whether this job's data plane is TCP for small payloads (large ones may take a device collective on GPU/TPU); validates $MULTIHOST_TRANSPORT."""
  return choice.tcp_enabled()


def tune_tcp(conn) -> None:
  """Gives a TCP socket the options the transport gives its TCP links (no delay, the congestion control of $MULTIHOST_TCP_CONGESTION): for references that should run on the links' medium (`bin/bench.py`'s raw stream and round trip)."""
  sockets.tune(conn)


def cpp_warnings_hidden():
  """A context in which JAX's C++ logs show errors only (see `multihost._src.runtime.companion.cpp_advice_hidden`)."""
  return companion.cpp_advice_hidden()


def key_value_set(key: str, value: bytes) -> None:
  """Sets (or replaces) `key` in the coordination service's key-value store."""
  coordination.kv_set(key, value)


def key_value_get(key: str, timeout: float) -> bytes:
  """The value of `key` in the coordination service's store, waiting up to `timeout` seconds."""
  return coordination.kv_get(key, timeout)


def key_value_dir(prefix: str) -> list[tuple[str, bytes]]:
  """Every (key, value) under `prefix` (ending with '/') in the coordination service's store."""
  return coordination.kv_dir(prefix)
