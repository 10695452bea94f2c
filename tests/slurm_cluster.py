"""A real Slurm on this machine for the tests: munged, slurmctld and slurmd, one node or two simulated hosts.

`shared(nodes)` gives a pytest session's cluster (started once, whichever
xdist worker asks first; a file lock orders them): a keeper process
(`python tests/slurm_cluster.py keep FOLDER NODES OWNER_PID`, in a session
of its own) starts it, writes FOLDER/status, and stops exactly what it
started once the pytest process that owns the session
($MULTIHOST_TEST_SESSION_PID, set by tests/conftest.py) is gone, on every
exit path of pytest (a SIGKILL included), and on its own SIGTERM.

* nodes=1: one node, `127.0.0.1` (a node name that is its own address, so
  no name needs resolving), in the machine's network namespace, on free
  ports; declared with 8 CPUs (`SlurmdParameters=config_overrides`), so
  2-4 tasks fit on 2 cores.
* nodes=2: three simulated hosts (`multihost.netns`, a bridge between
  network namespaces): slurmctld on host 0, one slurmd on each of hosts 1
  and 2 (`slurmd -N <address>`, `NodeAddr=<address>`), each in a UTS
  namespace whose hostname is its address (gloo picks its own address from
  the hostname). Clients (`sbatch`, `scontrol`, ...) run on host 0:
  `Cluster.client(argv)`. `nsenter --net`, not `ip netns exec` (which
  remounts /sys, and slurmd then finds no cgroup filesystem).

State, spool folders, logs, the munge key and socket live under FOLDER
(a temporary folder); nothing under /etc is touched. `available()` says why
not (not root, Debian's `slurm-wlm`/`munge` not installed: .ci/slurm
installs them). Standard library only (plus multihost.netns for 2 nodes).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SESSION_VARIABLE = 'MULTIHOST_TEST_SESSION_PID'
MARK_VARIABLE = 'MULTIHOST_TEST_SLURM'  # In every daemon's environment.
TOOLS = ('munged', 'slurmctld', 'slurmd', 'sbatch', 'srun', 'scontrol',
         'squeue', 'scancel', 'sinfo')
CPUS = 8
START_TIMEOUT_S = 60
_NETNS_DIR = '/var/run/netns'


class ClusterError(RuntimeError):
  """The cluster did not start (the message says what, and where its logs are)."""


def available() -> tuple[bool, str]:
  """Whether a Slurm can run here, and if not why."""
  if os.geteuid() != 0:
    return False, (f'a real Slurm needs root (it runs munged, slurmctld and '
                   f'slurmd); running as uid {os.geteuid()}.')
  missing = [t for t in TOOLS if shutil.which(t, path=_path()) is None]
  if missing:
    return False, (f'Slurm is not installed ({", ".join(missing)} not found): '
                   'as root, .ci/slurm installs Debian\'s slurm-wlm and munge.')
  return True, ''


def _path() -> str:
  return os.environ.get('PATH', '') + ':/usr/sbin:/sbin'


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class Cluster:
  """One Slurm cluster under `folder` (see the module docstring)."""

  def __init__(self, folder: str | os.PathLike[str], *, nodes: int = 1):
    if nodes not in (1, 2):
      raise ValueError(f'nodes must be 1 or 2; got {nodes!r}.')
    self.folder = pathlib.Path(folder)
    self.nodes = nodes
    self.conf = self.folder / 'slurm.conf'
    self._procs: list[tuple[str, subprocess.Popen]] = []
    self._hosts = None  # multihost.netns.SimulatedHosts for 2 nodes.
    self.node_names: list[str] = []
    self.namespaces: list[str] = []  # Host 0 (slurmctld, clients), 1, 2.

  # --- what tests use ---------------------------------------------------

  def env(self, **extra: str) -> dict[str, str]:
    """Variables for Slurm's clients: SLURM_CONF, plus `extra`."""
    return {'SLURM_CONF': str(self.conf), **extra}

  def client(self, argv: list[str]) -> list[str]:
    """`argv` (sbatch, scontrol, ...) where slurmctld can be reached."""
    if not self.namespaces:
      return list(argv)
    return ['nsenter', f'--net={_NETNS_DIR}/{self.namespaces[0]}', *argv]

  def describe(self) -> dict:
    return {'conf': str(self.conf), 'nodes': self.node_names,
            'namespaces': self.namespaces, 'folder': str(self.folder)}

  # --- lifecycle --------------------------------------------------------

  def start(self) -> None:
    """Starts munged, slurmctld and the slurmd(s); returns once every node is idle.

    Raises:
      ClusterError: a daemon exited or the nodes did not become idle within
        START_TIMEOUT_S (the message holds the logs' tails).
    """
    for sub in ('state', 'spool', 'log', 'munge'):
      (self.folder / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(self.folder / 'munge', 0o700)
    key = self.folder / 'munge' / 'munge.key'
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    try:
      self._start()
    except BaseException:
      self.stop()
      raise

  def _start(self) -> None:
    munge = self.folder / 'munge'
    self._spawn('munged', [
        'munged', '--foreground', '--force', f'--socket={munge}/socket',
        f'--key-file={munge}/munge.key', f'--pid-file={munge}/munged.pid',
        f'--seed-file={munge}/seed', f'--log-file={self.folder}/log/munged.log'
    ])
    if self.nodes == 1:
      ctld_host, ctld_addr = 'localhost', '127.0.0.1'
      ctld_port, slurmd_port = _free_port(), _free_port()
      self.node_names = ['127.0.0.1']
      addresses = ['127.0.0.1']
    else:
      from multihost import netns  # pylint: disable=g-import-not-at-top
      self._hosts = netns.SimulatedHosts(3)
      self._hosts.start()
      self.namespaces = [self._hosts.namespace(i) for i in range(3)]
      ctld_host = ctld_addr = self._hosts.address(0)
      ctld_port, slurmd_port = 6817, 6818
      addresses = [self._hosts.address(i) for i in (1, 2)]
      self.node_names = list(addresses)
    self._write_conf(ctld_host, ctld_addr, ctld_port, slurmd_port, addresses)
    self._wait_for_socket(munge / 'socket')
    conf = str(self.conf)
    self._spawn('slurmctld', self._on_host(0, ctld_host, [
        'slurmctld', '-D', '-i', '-f', conf]))
    for i, name in enumerate(self.node_names):
      self._spawn(f'slurmd-{name}', self._on_host(i + 1, name, [
          'slurmd', '-D', '-f', conf, '-N', name]))
    self._wait_idle()

  def _on_host(self, i: int, hostname: str, argv: list[str]) -> list[str]:
    """`argv` on simulated host i with its own hostname (2 nodes), else as is."""
    if not self.namespaces:
      return argv
    return ['nsenter', f'--net={_NETNS_DIR}/{self.namespaces[i]}', 'unshare',
            '--uts', 'sh', '-c', 'hostname "$0" && exec "$@"', hostname,
            *argv]

  def _write_conf(self, ctld_host, ctld_addr, ctld_port, slurmd_port,
                  addresses) -> None:
    f = self.folder
    nodes = '\n'.join(f'NodeName={a} NodeAddr={a} CPUs={CPUS} State=UNKNOWN'
                      for a in addresses)
    self.conf.write_text(f"""\
# A test cluster of tests/slurm_cluster.py; everything lives under {f}.
ClusterName=multihost-tests
SlurmctldHost={ctld_host}({ctld_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={f}/munge/socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={f}/state
SlurmdSpoolDir={f}/spool/%n
SlurmctldPidFile={f}/slurmctld.pid
SlurmdPidFile={f}/slurmd-%n.pid
SlurmctldLogFile={f}/log/slurmctld.log
SlurmdLogFile={f}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
# A requeued job held back (Reason=BeginTime) and then released is started
# by the backfill scheduler's next pass: every second, not every 30.
SchedulerParameters=bf_interval=1
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

  def _spawn(self, name: str, argv: list[str]) -> None:
    log = open(self.folder / 'log' / f'{name}.out', 'wb')
    env = dict(os.environ, SLURM_CONF=str(self.conf), PATH=_path(),
               **{MARK_VARIABLE: str(self.folder)})
    with log:
      proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                              stderr=subprocess.STDOUT, env=env)
    self._procs.append((name, proc))

  def _check_running(self) -> None:
    for name, proc in self._procs:
      if proc.poll() is not None:
        raise ClusterError(f'{name} exited with status {proc.returncode} '
                           f'while the cluster started.\n{self.logs()}')

  def _wait_for_socket(self, path: pathlib.Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not path.exists():
      self._check_running()
      if time.monotonic() > deadline:
        raise ClusterError(f'munged made no socket {path} within '
                           f'{START_TIMEOUT_S} s.\n{self.logs()}')
      time.sleep(0.05)

  def _wait_idle(self) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    resumed = False
    states = ''
    while time.monotonic() < deadline:
      self._check_running()
      done = subprocess.run(
          self.client(['sinfo', '--noheader', '--Node', '--format=%N %t']),
          env=dict(os.environ, **self.env()), capture_output=True, text=True,
          timeout=30, check=False)
      states = done.stdout + done.stderr
      got = dict(line.split()[:2] for line in done.stdout.splitlines()
                 if len(line.split()) >= 2)
      if got and all(got.get(n) == 'idle' for n in self.node_names):
        return
      if not resumed and any(s.startswith(('down', 'inval', 'drain'))
                             for s in got.values()):
        resumed = True
        subprocess.run(self.client(
            ['scontrol', 'update', f'nodename={",".join(self.node_names)}',
             'state=resume']), env=dict(os.environ, **self.env()),
                       capture_output=True, timeout=30, check=False)
      time.sleep(0.2)
    raise ClusterError(f'the nodes {self.node_names} were not idle within '
                       f'{START_TIMEOUT_S} s (sinfo: {states.strip()!r}).\n'
                       f'{self.logs()}')

  def logs(self, lines: int = 15) -> str:
    """The tails of the daemons' logs."""
    parts = []
    for path in sorted((self.folder / 'log').glob('*')):
      try:
        tail = path.read_text(errors='replace').splitlines()[-lines:]
      except OSError:
        continue
      parts.append(f'--- {path}\n' + '\n'.join(tail))
    return '\n'.join(parts)

  def stop(self) -> None:
    """Cancels every job, stops the daemons it started, then kills what is left of them; deletes the hosts."""
    if any(p.poll() is None for name, p in self._procs
           if name == 'slurmctld'):
      env = dict(os.environ, **self.env())
      subprocess.run(self.client(['scancel', '--signal=KILL', '--full',
                                  '--partition=test']),
                     env=env, capture_output=True, timeout=30, check=False)
      deadline = time.monotonic() + 10
      while time.monotonic() < deadline:
        done = subprocess.run(self.client(['squeue', '--noheader']), env=env,
                              capture_output=True, text=True, timeout=30,
                              check=False)
        if done.returncode or not done.stdout.strip():
          break
        time.sleep(0.2)
    for _, proc in reversed(self._procs):
      if proc.poll() is None:
        proc.terminate()
    for _, proc in reversed(self._procs):
      try:
        proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    self._procs = []
    _kill_marked(str(self.folder))  # slurmstepd and what it left.
    if self._hosts is not None:
      self._hosts.close()
      self._hosts = None


def _kill_marked(folder: str) -> None:
  """SIGKILLs every process (but this one) whose environment marks it as of the cluster in `folder`."""
  mark = f'{MARK_VARIABLE}={folder}'.encode()
  for pid in filter(str.isdigit, os.listdir('/proc')):
    if int(pid) == os.getpid():
      continue
    try:
      with open(f'/proc/{pid}/environ', 'rb') as f:
        if mark in f.read().split(b'\0'):
          os.kill(int(pid), signal.SIGKILL)
    except OSError:
      pass


# --- one cluster per pytest session ---------------------------------------


def _session_folder(nodes: int) -> pathlib.Path:
  owner = os.environ.get(SESSION_VARIABLE) or str(os.getpid())
  return pathlib.Path(tempfile.gettempdir()) / (
      f'multihost-slurm-{owner}-{nodes}n')


def shared(nodes: int = 1) -> Cluster:
  """The pytest session's cluster of `nodes` nodes, started on first use.

  Raises:
    ClusterError: it could not start (the message holds the daemons' logs).
    Unavailable is for the caller: check `available()` first.
  """
  owner = int(os.environ.get(SESSION_VARIABLE) or os.getpid())
  folder = _session_folder(nodes)
  lock_path = f'{folder}.lock'
  with open(lock_path, 'a') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    status = folder / 'status'
    if not status.exists():
      folder.mkdir(parents=True, exist_ok=True)
      with open(folder / 'keeper.log', 'wb') as log:
        subprocess.Popen(
            [sys.executable, __file__, 'keep', str(folder), str(nodes),
             str(owner)], stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT)))
      deadline = time.monotonic() + START_TIMEOUT_S + 30
      while not status.exists():
        if time.monotonic() > deadline:
          raise ClusterError(
              f'the Slurm keeper wrote no {status} within '
              f'{START_TIMEOUT_S + 30} s: {_tail(folder / "keeper.log")}')
        time.sleep(0.1)
    text = status.read_text()
  kind, _, body = text.partition('\n')
  if kind != 'ready':
    raise ClusterError(body)
  info = json.loads(body)
  cluster = Cluster(folder, nodes=nodes)
  cluster.node_names = info['nodes']
  cluster.namespaces = info['namespaces']
  return cluster


def _tail(path: pathlib.Path, n: int = 3000) -> str:
  try:
    return path.read_text(errors='replace')[-n:]
  except OSError as e:
    return f'({e})'


def _alive(pid: int) -> bool:
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] not in ('Z', 'X')
  except OSError:
    return False


def _keep(folder: str, nodes: int, owner: int) -> int:
  """The keeper: starts the cluster, reports, waits for `owner` to end, stops it."""
  stop = []
  signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # pytest's Ctrl-C is not ours.
  cluster = Cluster(folder, nodes=nodes)
  status = pathlib.Path(folder) / 'status'
  started = time.monotonic()
  try:
    try:
      cluster.start()
    except Exception as e:  # noqa: BLE001  Reported to the tests.
      _write(status, f'failed\n{type(e).__name__}: {e}')
    else:
      print(f'started in {time.monotonic() - started:.1f} s', flush=True)
      _write(status, 'ready\n' + json.dumps(cluster.describe()))
    while _alive(owner) and not stop:
      time.sleep(0.5)
  finally:
    cluster.stop()
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
      os.unlink(f'{folder}.lock')
  return 0


def _write(path: pathlib.Path, text: str) -> None:
  tmp = path.with_suffix('.tmp')
  tmp.write_text(text)
  os.replace(tmp, path)


if __name__ == '__main__':
  if len(sys.argv) == 5 and sys.argv[1] == 'keep':
    sys.exit(_keep(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
  sys.stderr.write(f'usage: {sys.argv[0]} keep FOLDER NODES OWNER_PID\n')
  sys.exit(2)
