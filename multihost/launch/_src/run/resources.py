"""What a run holds beside its processes, from its start to its stop: the simulated hosts, the job secret's variables, the compilation cache folder, the coordinator port between attempts, the coordination service it hosts."""

from __future__ import annotations

import collections.abc
import shutil
import socket
from typing import TYPE_CHECKING

from multihost import env as env_lib
from multihost.launch._src.processes import environment as _environment

if TYPE_CHECKING:  # (imported when used: only with hosts='netns')
  from multihost import netns


class Resources:
  """A run's hosts, secret, cache folder, port and hosted service (see `Controllers`' arguments of the same names)."""

  def __init__(self, *, num_processes: int, port: int | None,
               hosts_kind: str | None, host_service: bool,
               heartbeat_timeout: float, cache_choice: str | None,
               extra_env: collections.abc.Mapping[str, str]):
    self.num_processes = num_processes
    self.port = port
    self._fixed_port = port
    self.hosts_kind = hosts_kind
    self.host_service = host_service
    self.heartbeat_timeout = heartbeat_timeout
    self._cache_choice = cache_choice
    self._extra_env = extra_env
    # The SimulatedHosts while running, with hosts='netns'.
    self.hosts: netns.SimulatedHosts | None = None
    self.secret_env: dict[str, str] = {}
    # The folder the attempts get (None: the user's setting, or none).
    self.compilation_cache_dir: str | None = None
    self._own_cache_dir: str | None = None  # Made here; removed at close().
    self._service = None
    self._port_hold: socket.socket | None = None  # (`hold_free_port`)

  def open(self, *, max_restarts: int) -> None:
    """At the run's start: the simulated hosts, the job secret, the compilation cache folder."""
    if self.hosts_kind == _environment.NETNS:
      from multihost import netns as hosts_lib  # pylint: disable=g-import-not-at-top
      self.hosts = hosts = hosts_lib.SimulatedHosts(self.num_processes)
      hosts.start()
    self.secret_env = env_lib.job_secret_env(self._extra_env)
    self.compilation_cache_dir, self._own_cache_dir = (
        _environment.compilation_cache_dir(
            self._cache_choice, extra_env=self._extra_env,
            max_restarts=max_restarts))

  def next_port(self) -> int:
    """The coordinator port of the next attempt: the fixed one, else a free one held until the run ends (see `hold_free_port`)."""
    self.port = self._fixed_port
    if not self.port:
      self.release_port()
      self._port_hold = hold = _environment.hold_free_port()
      self.port = hold.getsockname()[1]
    return self.port

  def service_env(self) -> dict[str, str]:
    """The attempt's service variables: with `host_service`, the service is started here first; the job secret's always."""
    service_env = {}
    if self.host_service:
      from multihost import lowlevel  # pylint: disable=g-import-not-at-top
      self._service = lowlevel.start_service(
          f'127.0.0.1:{self.port}', self.num_processes,
          heartbeat_timeout=int(self.heartbeat_timeout))
      service_env = env_lib.external_service_env(self.heartbeat_timeout)
    service_env.update(self.secret_env)
    return service_env

  def stop_service(self) -> None:
    """Stops the hosted coordination service, if one runs."""
    if self._service is not None:
      self._service.shutdown()
      self._service = None

  def close(self) -> None:
    """At the run's stop: deletes the simulated hosts and the compilation cache folder made here; releases the port."""
    if self.hosts is not None:
      self.hosts.close()  # Also kills anything left inside them.
    if self._own_cache_dir is not None:
      shutil.rmtree(self._own_cache_dir, ignore_errors=True)
      self._own_cache_dir = None
    self.release_port()

  def release_port(self) -> None:
    if self._port_hold is not None:
      self._port_hold.close()
      self._port_hold = None
