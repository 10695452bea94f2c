"""Environment variable names, and the launcher<->controller contract (JAX-free).

This module imports neither JAX nor any other part of `multihost`, so the
launcher and the pytest plugin can use it before (or without) JAX. Each
environment variable the project reads or sets is named here, once; other
modules refer to these constants.
"""

from __future__ import annotations

from collections.abc import Mapping
import os
import secrets

# --- Read by `multihost.initialize()`; set by `multihost.launch`. -----------
COORDINATOR = 'JAX_COORDINATOR_ADDRESS'
COORDINATOR_BIND = 'JAX_COORDINATOR_BIND_ADDRESS'
COORDINATOR_PORT = 'JAX_COORDINATOR_PORT'
NUM_PROCESSES = 'JAX_NUM_PROCESSES'
PROCESS_ID = 'JAX_PROCESS_ID'
NUM_CPU_DEVICES = 'JAX_NUM_CPU_DEVICES'
LOCAL_DEVICE_IDS = 'JAX_LOCAL_DEVICE_IDS'
PLATFORMS = 'JAX_PLATFORMS'
ENABLE_RECOVERABILITY = 'JAX_ENABLE_RECOVERABILITY'
PYTHON_UNBUFFERED = 'PYTHONUNBUFFERED'

# --- multihost's own settings. ---------------------------------------------
TIMEOUT = 'MULTIHOST_TIMEOUT'
HEARTBEAT = 'MULTIHOST_HEARTBEAT_TIMEOUT'
DETECT_FAILURES = 'MULTIHOST_DETECT_FAILURES'
TRANSPORT = 'MULTIHOST_TRANSPORT'
# Seconds a collective waits before logging where the missing processes are
# (0: never); see `multihost.set_stall_report_after`.
STALL_REPORT_AFTER = 'MULTIHOST_STALL_REPORT_AFTER'
# Set to 1 by a launcher that hosts the coordination service itself: process
# 0 then starts no service of its own.
EXTERNAL_SERVICE = 'MULTIHOST_EXTERNAL_SERVICE'
# The job secret that authenticates the data plane and the control plane's
# messages: the secret itself, or the path of a file only its owner can read.
# The launcher sets JOB_SECRET for its controllers; without either, process 0
# makes one and shares it through the coordination service.
JOB_SECRET = 'MULTIHOST_JOB_SECRET'
JOB_SECRET_FILE = 'MULTIHOST_JOB_SECRET_FILE'
# The largest pickled object (bytes) `broadcast_object`/`allgather_object`
# accept from a peer (default 1 GiB).
MAX_OBJECT_BYTES = 'MULTIHOST_MAX_OBJECT_BYTES'
# Set to 0 so that process 0 hosts the coordination service itself (plain
# JAX: its death aborts the others). Otherwise a companion process of
# process 0 hosts it (`multihost._src.runtime.companion`): a crash of process 0's
# trainer is then an ordinary failure, also outside the launcher.
COMPANION_SERVICE = 'MULTIHOST_COMPANION_SERVICE'
# Set to 0 so that a process whose peer failed never leaves by itself (see
# `multihost.set_exit_on_peer_failure`, which overrides it).
EXIT_ON_PEER_FAILURE = 'MULTIHOST_EXIT_ON_PEER_FAILURE'

# How long a training step may take before the process leaves with exit
# status 75 (see `multihost.set_step_deadline`, which overrides it): unset or
# 'auto': learned from the step times; 'off' or 0: never; SECONDS: fixed.
STEP_DEADLINE = 'MULTIHOST_STEP_DEADLINE'

# Idle result buffers (MiB) each process keeps for the next large collective
# (default 512; 0: none); see `multihost._src.transport.buffers`.
RESULT_POOL_MIB = 'MULTIHOST_RESULT_POOL_MIB'
# TCP connections per pair of processes that a large broadcast stripes over
# (default 2; 1: one); the same on every process. See `multihost._src.transport.tcp.chain`.
TCP_LANES = 'MULTIHOST_TCP_LANES'
# The congestion control of the TCP links (TCP_CONGESTION): unset or 'auto':
# reno where the host's default paces each flow (bbr), else the host's
# default; 'keep': the host's default always; NAME: that one (e.g. cubic).
# See `multihost._src.transport.tcp.sockets`.
TCP_CONGESTION = 'MULTIHOST_TCP_CONGESTION'
# Links between processes on one host (one network namespace) go over a
# local (Unix domain) socket instead of TCP loopback (default on; 0: TCP
# for every link). See `multihost._src.transport.tcp.link`.
LOCAL_LINKS = 'MULTIHOST_LOCAL_LINKS'

# Calls (and events) each process's flight recorder keeps (default 64); see
# `multihost._src.runtime.flight`.
FLIGHT_RING = 'MULTIHOST_FLIGHT_RING'
# Set by `multihost.launch --trace`: the folder where each controller writes
# its flight recorder at exit (process-N.json), for the launcher to merge.
TRACE_DIR = 'MULTIHOST_TRACE_DIR'

# Set to 0 to keep gloo's connection lines ("[Gloo] Rank N is connected to
# ...") in the output that the launcher and `python -m multihost.launch.quiet`
# (docs/restart.sbatch) read; they drop them otherwise. A controller's own
# stdout is never touched. See `multihost._src.diagnostics.gloo_lines`.
QUIET_GLOO = 'MULTIHOST_QUIET_GLOO'

# --- Other variables the packages, bin/ and bench/ read or set. ------------
# JAX's (XLA's) threshold for its C++ log lines (0 all, 1 warnings, 2 errors).
CPP_LOG_LEVEL = 'TF_CPP_MIN_LOG_LEVEL'
# JAX's: log every compilation; the persistent compilation cache on or off;
# the shortest compile (seconds) the cache keeps.
LOG_COMPILES = 'JAX_LOG_COMPILES'
ENABLE_COMPILATION_CACHE = 'JAX_ENABLE_COMPILATION_CACHE'
CACHE_MIN_COMPILE_TIME = 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'
# Where programs and Python modules are found.
PATH = 'PATH'
PYTHONPATH = 'PYTHONPATH'
# The default of `multihost.netns.SimulatedHosts(private_folder=...)` when
# set and not empty.
NETNS_PRIVATE_FOLDER = 'MULTIHOST_NETNS_PRIVATE_FOLDER'
# Overrides the local checkpoint folder's identity that tells `recovery`'s
# local tier's hosts apart: processes with the same value share one folder.
RECOVERY_HOST_ID = 'RECOVERY_HOST_ID'
# bench/scale_drill.py: the launch's wall-clock time, for its controllers.
SCALE_DRILL_LAUNCH_T0 = 'SCALE_DRILL_LAUNCH_T0'

# --- The pytest plugin's workers. ------------------------------------------
# Set in worker pytest sessions: the folder where they write their results.
PYTEST_WORKER = 'MULTIHOST_PYTEST_WORKER'
# Seconds a worker waits at the per-test barriers.
PYTEST_BARRIER_TIMEOUT = 'MULTIHOST_PYTEST_BARRIER_TIMEOUT'
# Multiplies every group's timeout (e.g. 3 on a slow CI machine); unset: the
# parent scales it with the machine's load (`multihost.testing`).
PYTEST_TIMEOUT_SCALE = 'MULTIHOST_PYTEST_TIMEOUT_SCALE'
PYTEST_DISABLE_PLUGIN_AUTOLOAD = 'PYTEST_DISABLE_PLUGIN_AUTOLOAD'

# --- Open MPI's variables (JAX's OmpiCluster auto-detects them). ----------
OMPI_HNP_URI = 'OMPI_MCA_orte_hnp_uri'
OMPI_SIZE = 'OMPI_COMM_WORLD_SIZE'
OMPI_RANK = 'OMPI_COMM_WORLD_RANK'
OMPI_LOCAL_RANK = 'OMPI_COMM_WORLD_LOCAL_RANK'
OMPI_LOCAL_SIZE = 'OMPI_COMM_WORLD_LOCAL_SIZE'
# Open MPI 5's launcher (PRRTE) sets these and OMPI_COMM_WORLD_*, not
# OMPI_MCA_orte_hnp_uri: JAX detects no cluster there, `multihost.initialize()`
# does (`multihost._src.clusters.prrte`).
PRTE_LAUNCHED = 'PRTE_LAUNCHED'
PMIX_NAMESPACE = 'PMIX_NAMESPACE'
# Where Open MPI 5 and its PMIx are installed (libpmix is searched there).
PMIX_PREFIX = 'PMIX_PREFIX'
OPAL_PREFIX = 'OPAL_PREFIX'

# --- Slurm's variables (JAX's SlurmCluster auto-detects them). -------------
SLURM_JOB_ID = 'SLURM_JOB_ID'
SLURM_STEP_NODELIST = 'SLURM_STEP_NODELIST'
SLURM_NTASKS = 'SLURM_NTASKS'
SLURM_PROCID = 'SLURM_PROCID'
SLURM_LOCALID = 'SLURM_LOCALID'
# Set by Slurm on a requeue (read by `recovery` as a restart count).
SLURM_RESTART_COUNT = 'SLURM_RESTART_COUNT'

# --- Kubernetes' variables. --------------------------------------------
# Set in every pod (the API server's address).
K8S_SERVICE_HOST = 'KUBERNETES_SERVICE_HOST'
# Set in each pod of an indexed Job (`completionMode: Indexed`, also a
# JobSet's Jobs): its index, JAX's process index there.
JOB_COMPLETION_INDEX = 'JOB_COMPLETION_INDEX'

# --- Cloud TPU's variables (JAX's GKE and GCE TPU cluster detection). ----
# The hosts of a TPU slice, comma-separated (GKE sets them; JAX reads
# TPU_PROCESS_ADDRESSES first); this host's index among them.
TPU_PROCESS_ADDRESSES = 'TPU_PROCESS_ADDRESSES'
TPU_WORKER_HOSTNAMES = 'TPU_WORKER_HOSTNAMES'
TPU_WORKER_ID = 'TPU_WORKER_ID'
# Set: JAX never asks the GCE metadata server (JAX sets it where no TPU chip is).
TPU_SKIP_MDS_QUERY = 'TPU_SKIP_MDS_QUERY'
# Multislice (slices joined over the data-center network).
MEGASCALE_COORDINATOR_ADDRESS = 'MEGASCALE_COORDINATOR_ADDRESS'
MEGASCALE_NUM_SLICES = 'MEGASCALE_NUM_SLICES'
MEGASCALE_SLICE_ID = 'MEGASCALE_SLICE_ID'
# The GCE metadata server's address (default metadata.google.internal).
GCE_METADATA_IP = 'GCE_METADATA_IP'

# Variables whose presence means a cluster JAX can auto-detect (Kubernetes:
# an indexed Job's two variables above; Cloud TPU: `multihost._src.clusters.tpu`,
# since a lone TPU machine has TPU_WORKER_HOSTNAMES too).
CLUSTER_MARKERS = (SLURM_JOB_ID, OMPI_HNP_URI, OMPI_SIZE, 'PMI_RANK')

# With failure detection on, a killed peer is reported within about this many
# seconds (plus 2 s); JAX's own default (100 s) is meant for large TPU jobs.
DEFAULT_HEARTBEAT_S = 10

def controller_env(process_id: int, *, num_processes: int,
                   devices_per_process: int, port: int,
                   base: Mapping[str, str] | None = None,
                   host: str = '127.0.0.1') -> dict[str, str]:
  """The environment of controller `process_id` of a local run.

  It makes `multihost.initialize()` (which reads `JAX_COORDINATOR_ADDRESS`,
  `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`) and a bare
  `jax.distributed.initialize()` (which reads `JAX_COORDINATOR_ADDRESS`,
  `JAX_COORDINATOR_BIND_ADDRESS` and detects Open MPI from
  `OMPI_MCA_orte_hnp_uri` and `OMPI_COMM_WORLD_*`) both work, on CPU with
  `devices_per_process` devices each, with the coordinator bound to `host`.

  Args:
    process_id: this controller's index.
    num_processes: number of controllers.
    devices_per_process: CPU devices per controller (`JAX_NUM_CPU_DEVICES`).
    port: the coordinator's port.
    base: environment to start from (default: `os.environ`).
    host: the coordinator's address.

  Returns:
    A new environment dictionary.
  """
  env = dict(os.environ if base is None else base)
  address = f'{host}:{port}'
  env.update({
      COORDINATOR: address,
      COORDINATOR_BIND: address,
      COORDINATOR_PORT: str(port),
      NUM_PROCESSES: str(num_processes),
      PROCESS_ID: str(process_id),
      NUM_CPU_DEVICES: str(devices_per_process),
      PLATFORMS: 'cpu',
      # The coordinator host comes from the URI, the port from
      # JAX_COORDINATOR_PORT.
      OMPI_HNP_URI: f'{port << 12}.0;tcp://{host}:{port}',
      OMPI_SIZE: str(num_processes),
      OMPI_RANK: str(process_id),
      OMPI_LOCAL_RANK: str(process_id),
      OMPI_LOCAL_SIZE: str(num_processes),
      # Lines reach the launcher (and the user) as they are printed.
      PYTHON_UNBUFFERED: '1',
  })
  return env


def job_secret_env(extra: Mapping[str, str]) -> dict[str, str]:
  """A fresh job secret for a launcher's controllers, unless the user gives one."""
  if any(k in extra or os.environ.get(k) for k in (JOB_SECRET,
                                                    JOB_SECRET_FILE)):
    return {}
  return {JOB_SECRET: secrets.token_hex(32)}


def external_service_env(heartbeat_timeout_s: float) -> dict[str, str]:
  """What a launcher that hosts the coordination service tells its controllers."""
  return {EXTERNAL_SERVICE: '1', HEARTBEAT: str(int(heartbeat_timeout_s))}

# --- Set by `multihost.launch` for each controller. ------------------------
# How many times the launcher restarted the job before this attempt (0, 1,
# ...; `--max_restarts`), as torchrun exports TORCHELASTIC_RESTART_COUNT.
RESTART_COUNT = 'MULTIHOST_RESTART_COUNT'
# JAX's persistent compilation cache folder. Under `--max_restarts` the
# launcher gives every attempt the same one (unless the user set it), so that
# a restarted attempt loads what the first one compiled.
COMPILATION_CACHE_DIR = 'JAX_COMPILATION_CACHE_DIR'

# --- Exit statuses: what a controller's status tells its launcher. ---------
# "Restarting will not help" (BSD's EX_CONFIG, a configuration error): a
# controller exits with it for bad flags or usage, a checkpoint that is
# required and missing or does not fit, or a configuration the processes
# disagree on. Every attempt would fail the same way, so `multihost.launch
# --max_restarts` and docs/restart.sbatch end the run after the attempt in
# which a controller exited with it, and say so, instead of spending their
# restarts. (A survivor that left because a peer failed exits with 75,
# EX_TEMPFAIL: a restart may help; see `multihost.set_exit_on_peer_failure`.)
NO_RETRY_EXIT_STATUS = 78
