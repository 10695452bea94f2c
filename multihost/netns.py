"""Simulated hosts on one machine: one network namespace per host, a switch between them, link faults.

Each host is a Linux network namespace with one interface (`eth0`, an address
in a private test subnet) plugged into a bridge that lives in a "switch"
namespace of its own, so nothing touches the machine's own interfaces or
routes. Programs run inside a host through `command(i, argv)`, which also
gives them a UTS namespace whose hostname is the host's address: gloo (JAX's
CPU collectives) resolves the hostname to pick its own address, and would
otherwise pick 127.0.0.1. Faults: `cut(i)`/`restore(i)` take host i's link
down and up; `delay(i, ms)` adds latency where the kernel has `sch_netem`.

Per-host local disks: with `private_folder=PATH` (or
$MULTIHOST_NETNS_PRIVATE_FOLDER, so that `python -m multihost.launch
--hosts=netns` gets it too), every program on host i also runs in a mount
namespace of its own, where PATH is a bind mount of `host_folder(i)`
(`PATH.host<i>`, created when needed): the same path on every host, on
different "disks", as separate machines have. Wiping `host_folder(i)` from
outside replaces host i's disk. Nothing stays mounted once the programs
exit: the mounts live in their private namespaces only.

Needs root, `ip` and `unshare`; `available()` says whether it can work here.
JAX-free and standard-library only.

Example (run your own program on 2 simulated hosts, cut host 1 for 2 s)::

  import subprocess, time
  from multihost import env, hosts

  ok, why = hosts.available()
  assert ok, why
  with hosts.SimulatedHosts(2) as net:
    procs = []
    for i in range(2):
      e = env.controller_env(i, num_processes=2, devices_per_process=1,
                             port=12345, host=net.address(0))
      procs.append(subprocess.Popen(net.command(i, ['python', 'train.py']),
                                    env=e))
    time.sleep(10)
    net.cut(1)            # host 1 unreachable; processes keep running
    time.sleep(2)
    net.restore(1)
    for p in procs:
      p.wait(timeout=600)
  # Namespaces, links and any process still inside them are gone here.
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
import threading

from multihost import env

PREFIX = 'mhh-'
"""Every namespace this module creates is named `mhh-<pid>-<n>-...`."""

PRIVATE_FOLDER_VARIABLE = env.NETNS_PRIVATE_FOLDER
"""The default of `SimulatedHosts(private_folder=...)` when set and not empty."""
_CMD_TIMEOUT = 30
_counter = itertools.count()
_live: set[SimulatedHosts] = set()
_live_lock = threading.Lock()


class HostsError(RuntimeError):
  """A simulated-hosts operation failed (the message names the command)."""


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
  try:
    done = subprocess.run(argv, capture_output=True, text=True,
                          timeout=_CMD_TIMEOUT)
  except FileNotFoundError as e:
    raise HostsError(
        f'`{argv[0]}` is not on PATH ({os.environ.get(env.PATH, "")}): install '
        'iproute2 (it has ip and tc), or put the folder that holds it (e.g. '
        '/usr/sbin) on PATH.') from e
  except subprocess.TimeoutExpired as e:
    raise HostsError(f'`{" ".join(argv)}` did not finish within '
                     f'{_CMD_TIMEOUT} s.') from e
  if check and done.returncode != 0:
    raise HostsError(f'`{" ".join(argv)}` failed (exit {done.returncode}): '
                     f'{done.stderr.strip() or done.stdout.strip()}')
  return done


def available() -> tuple[bool, str]:
  """Whether simulated hosts work here: (True, '') or (False, the reason)."""
  if os.name != 'posix' or not hasattr(os, 'geteuid'):
    return False, 'simulated hosts need Linux network namespaces.'
  if os.geteuid() != 0:
    return False, ('simulated hosts need root (to create network '
                   f'namespaces); running as uid {os.geteuid()}.')
  for tool in ('ip', 'unshare'):
    if shutil.which(tool) is None:
      return False, f'simulated hosts need `{tool}` on PATH; it is missing.'
  probe = f'{PREFIX}{os.getpid()}-probe{next(_counter)}'
  try:
    _run(['ip', 'netns', 'add', probe])
  except HostsError as e:
    return False, f'cannot create a network namespace: {e}'
  finally:
    _run(['ip', 'netns', 'del', probe], check=False)
  return True, ''


def _namespaces() -> list[str]:
  out = _run(['ip', 'netns', 'list'], check=False).stdout
  return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _kill_inside(namespace: str) -> None:
  """SIGKILLs every process still running in `namespace` and reaps none."""
  out = _run(['ip', 'netns', 'pids', namespace], check=False).stdout
  for word in out.split():
    if word.isdigit() and int(word) != os.getpid():
      try:
        os.kill(int(word), signal.SIGKILL)
      except OSError:
        pass


def _delete(namespaces: list[str]) -> None:
  for ns in namespaces:
    _kill_inside(ns)
  # The switch first: deleting it deletes every veth pair (both ends).
  for ns in sorted(namespaces, key=lambda n: not n.endswith('-sw')):
    _run(['ip', 'netns', 'del', ns], check=False)


def cleanup_stale() -> list[str]:
  """Deletes namespaces of this module left by runs whose process is dead.

  Returns:
    The names of the namespaces deleted.
  """
  stale = []
  for ns in _namespaces():
    if not ns.startswith(PREFIX):
      continue
    pid = ns[len(PREFIX):].split('-', 1)[0]
    if pid.isdigit() and not _pid_alive(int(pid)):
      stale.append(ns)
  _delete(stale)
  return stale


def _pick_subnet() -> ipaddress.IPv4Network:
  """A /24 in 10.0.0.0/8 that no route or address on the machine overlaps."""
  used = []
  out = _run(['ip', '-o', '-4', 'route', 'show', 'table', 'all'],
             check=False).stdout
  out += _run(['ip', '-o', '-4', 'addr'], check=False).stdout
  for word in out.split():
    try:
      used.append(ipaddress.ip_network(word, strict=False))
    except ValueError:
      continue
  for third in itertools.chain([213], range(214, 256), range(0, 213)):
    net = ipaddress.IPv4Network(f'10.{third}.0.0/24')
    if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
      return net
  raise HostsError('no free /24 in 10.0.0.0/8 for simulated hosts; pass '
                   'subnet= explicitly.')


class SimulatedHosts:
  """`n` hosts in network namespaces, joined by a bridge; a context manager.

  Entering creates them (and first deletes leftovers of crashed runs);
  leaving deletes them, on every exit path (also at interpreter exit), and
  kills any process still running inside them. A process killed by a
  signal runs neither: the next `SimulatedHosts` (or `cleanup_stale()`)
  deletes what it left, since its pid is in the names.

  Args:
    n: number of hosts (1..250).
    subnet: an IPv4 network for the hosts' addresses (host i gets the
      (i+1)-th address). Default: a /24 in 10.0.0.0/8 no route or address
      on this machine overlaps. It exists only inside these namespaces.
    private_folder: an absolute path that each host sees as a folder of its
      own, `host_folder(i)` (see the module docstring). Default:
      $MULTIHOST_NETNS_PRIVATE_FOLDER, else none.
  """

  def __init__(self, n: int, *, subnet: str | None = None,
               private_folder: str | os.PathLike[str] | None = None):
    if not 1 <= n <= 250:
      raise ValueError(f'SimulatedHosts needs 1 <= n <= 250; got n={n}.')
    if private_folder is None:
      private_folder = os.environ.get(PRIVATE_FOLDER_VARIABLE, '').strip()
    private_folder = os.fspath(private_folder) if private_folder else None
    if private_folder is not None and (
        not os.path.isabs(private_folder)
        or os.path.normpath(private_folder) == '/'):
      raise ValueError(
          f'private_folder (${PRIVATE_FOLDER_VARIABLE}) must be an absolute '
          f'path other than /; got {private_folder!r}. Pass a folder such '
          'as /tmp/run/local.')
    self.private_folder = (os.path.normpath(private_folder)
                           if private_folder is not None else None)
    self.n = n
    self._subnet_arg = subnet
    self.subnet: ipaddress.IPv4Network | None = None
    self.name = f'{PREFIX}{os.getpid()}-{next(_counter)}'
    self.switch = f'{self.name}-sw'
    self.hosts = [f'{self.name}-h{i}' for i in range(n)]
    self._created: list[str] = []
    self._up = False
    self._owner = os.getpid()  # A forked child must not tear them down.

  # --- lifecycle ----------------------------------------------------------

  def __enter__(self) -> SimulatedHosts:
    self.start()
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def start(self) -> None:
    """Creates the switch, the hosts and their links."""
    if self._up:
      return
    ok, why = available()
    if not ok:
      raise HostsError(why)
    cleanup_stale()
    subnet = (_pick_subnet() if self._subnet_arg is None
              else ipaddress.ip_network(self._subnet_arg))
    if not isinstance(subnet, ipaddress.IPv4Network):
      raise ValueError(f'subnet {subnet} is not an IPv4 network; pass one '
                       'such as 10.213.0.0/24.')
    if subnet.num_addresses < self.n + 2:
      raise ValueError(f'subnet {subnet} is too small for {self.n} '
                       'hosts.')
    self.subnet = subnet
    with _live_lock:
      _live.add(self)
    self._up = True
    try:
      sw = self.switch
      self._add_ns(sw)
      _run(['ip', '-n', sw, 'link', 'add', 'br0', 'type', 'bridge',
            'forward_delay', '0', 'stp_state', '0'])
      _run(['ip', '-n', sw, 'link', 'set', 'br0', 'up'])
      for i, ns in enumerate(self.hosts):
        self._add_ns(ns)
        port = self._port(i)
        # Created inside the namespaces: no name ever appears in the root
        # namespace, and deleting the switch deletes both ends.
        _run(['ip', '-n', sw, 'link', 'add', port, 'type', 'veth', 'peer',
              'name', 'eth0', 'netns', ns])
        _run(['ip', '-n', sw, 'link', 'set', port, 'master', 'br0'])
        _run(['ip', '-n', sw, 'link', 'set', port, 'up'])
        _run(['ip', '-n', ns, 'addr', 'add',
              f'{self.address(i)}/{subnet.prefixlen}', 'dev', 'eth0'])
        _run(['ip', '-n', ns, 'link', 'set', 'eth0', 'up'])
        _run(['ip', '-n', ns, 'link', 'set', 'lo', 'up'])
    except BaseException:
      self.close()
      raise

  def _add_ns(self, ns: str) -> None:
    self._created.append(ns)
    _run(['ip', 'netns', 'add', ns])

  def close(self) -> None:
    """Deletes the hosts, the switch and their links; kills what runs inside."""
    if not self._up or os.getpid() != self._owner:
      return
    self._up = False
    _delete(self._created)
    self._created = []
    with _live_lock:
      _live.discard(self)

  # --- facts --------------------------------------------------------------

  def address(self, i: int) -> str:
    """Host i's IPv4 address."""
    self._check(i)
    if self.subnet is None:  # (set before the hosts run)
      raise HostsError(f'{self.name}: the simulated hosts have no subnet.')
    return str(self.subnet.network_address + i + 1)

  def namespace(self, i: int) -> str:
    """The name of host i's network namespace."""
    self._check(i)
    return self.hosts[i]

  def host_folder(self, i: int) -> str:
    """The folder host i sees at `private_folder` (its own "disk")."""
    if self.private_folder is None:
      raise HostsError(f'{self.name}: these simulated hosts have no private '
                       'folder; pass SimulatedHosts(n, private_folder=PATH) '
                       f'or set ${PRIVATE_FOLDER_VARIABLE}.')
    if not 0 <= i < self.n:
      raise IndexError(f'{self.name}: no host {i}; hosts are 0..{self.n - 1}.')
    return f'{self.private_folder}.host{i}'

  def _port(self, i: int) -> str:
    return f'p{i}'

  def _check(self, i: int) -> None:
    if not self._up:
      raise HostsError(f'{self.name}: the simulated hosts are not running; '
                       'use them inside `with SimulatedHosts(n) as net:`.')
    if not 0 <= i < self.n:
      raise IndexError(f'{self.name}: no host {i}; hosts are 0..{self.n - 1}.')

  def command(self, i: int, argv: list[str]) -> list[str]:
    """`argv` run inside host i, with hostname = host i's address.

    With a private folder, also in a mount namespace of its own where
    `private_folder` is a bind mount of `host_folder(i)`. The prefix
    `exec`s all the way down, so a `subprocess.Popen` of the result has the
    pid of `argv`'s process (signals reach it directly).
    """
    prefix = ['ip', 'netns', 'exec', self.namespace(i), 'unshare', '--uts']
    if self.private_folder is None:
      return [*prefix, 'sh', '-c', 'hostname "$0" && exec "$@"',
              self.address(i), *argv]
    # A private mount namespace: the bind mount never reaches the root one.
    return [*prefix, '--mount', '--propagation', 'private', 'sh', '-c',
            'hostname "$0" && mkdir -p "$1" "$2" && mount --bind "$1" "$2" '
            '&& shift 2 && exec "$@"', self.address(i), self.host_folder(i),
            self.private_folder, *argv]

  # --- faults -------------------------------------------------------------

  def cut(self, i: int) -> None:
    """Takes host i's link down: nothing reaches it or leaves it."""
    self._check(i)
    _run(['ip', '-n', self.switch, 'link', 'set', self._port(i), 'down'])

  def restore(self, i: int) -> None:
    """Brings host i's link back up."""
    self._check(i)
    _run(['ip', '-n', self.switch, 'link', 'set', self._port(i), 'up'])

  def delay(self, i: int, ms: float) -> None:
    """Delays every packet to or from host i by `ms` (0 removes the delay).

    Raises:
      HostsError: no `tc` on PATH, or the kernel has no `sch_netem` (the
        message says which).
    """
    self._check(i)
    if shutil.which('tc') is None:
      raise HostsError(
          f'{self.name}: cannot delay host {i}: `tc` is not on PATH (iproute2\'s '
          'tc and the kernel\'s sch_netem simulate delays); delays cannot be '
          'simulated here, only cuts. Put the folder that holds tc (e.g. '
          '/usr/sbin) on PATH.')
    ends = [(self.switch, self._port(i)), (self.namespace(i), 'eth0')]
    for ns, dev in ends:
      if ms <= 0:
        _run(['tc', '-n', ns, 'qdisc', 'del', 'dev', dev, 'root'],
             check=False)
        continue
      done = _run(['tc', '-n', ns, 'qdisc', 'replace', 'dev', dev, 'root',
                   'netem', 'delay', f'{ms}ms'], check=False)
      if done.returncode != 0:
        raise HostsError(
            f'{self.name}: cannot delay host {i}: `tc qdisc ... netem` '
            f'failed ({done.stderr.strip()}). This kernel has no sch_netem '
            '(or no tc); delays cannot be simulated here, only cuts.')


@atexit.register
def _close_all() -> None:
  with _live_lock:
    live = list(_live)
  for hosts in live:
    hosts.close()
