"""Semi-public seams for tools and tests: the raw coordination barrier, service hosting, transport choice, the TCP links' socket options.

These are what `bin/bench.py`, the launcher and the tests need below the
collectives. They are not part of the `jax.experimental.multihost_utils`
surface and carry no compatibility promise; training code should not need
them. Nothing outside `multihost/` imports a private `multihost._*` module:
it goes through here.
"""

from __future__ import annotations

import multihost._src.api  # noqa: F401  Assembles the runtimes this uses.
from multihost._src.liveness import watchdog
from multihost._src.runtime import companion
from multihost._src.runtime import coordination
from multihost._src.runtime import failures
from multihost._src.runtime import files
from multihost._src.runtime import settings
from multihost._src.transport import choice
from multihost._src.transport.tcp import sockets


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


def max_object_bytes() -> int:
  """The largest pickled object an object collective accepts from one process ($MULTIHOST_MAX_OBJECT_BYTES, default 1 GiB): what a caller that sends more must cut it below."""
  return settings.max_object_bytes()


def process_prefix(index: int | None = None) -> str:
  """'[process=N]' for this process (or `index`): how every message of the project starts."""
  return failures.prefix(index)


def shorten(message: object, limit: int = 400) -> str:
  """`message` (a string or an exception) on one line, cut to `limit` characters."""
  return failures.shorten(message, limit)


def key_value_set(key: str, value: bytes) -> None:
  """Sets (or replaces) `key` in the coordination service's key-value store."""
  coordination.kv_set(key, value)


def key_value_get(key: str, timeout: float) -> bytes:
  """The value of `key` in the coordination service's store, waiting up to `timeout` seconds."""
  return coordination.kv_get(key, timeout)


def key_value_dir(prefix: str) -> list[tuple[str, bytes]]:
  """Every (key, value) under `prefix` (ending with '/') in the coordination service's store."""
  return coordination.kv_dir(prefix)


def write_atomic(path, data: bytes | str, *, mode: int = 0o644,
                 sync: bool = True) -> None:
  """Replaces file `path` with `data` at once, never through a link (see `multihost._src.runtime.files`)."""
  files.write_atomic(path, data, mode=mode, sync=sync)


def fsync_folder(folder) -> None:
  """Flushes `folder`'s entries to disk (after a rename in it), never through a link."""
  files.fsync_folder(folder)
