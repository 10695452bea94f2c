"""recovery: resilient multi-controller training built on `multihost` and Orbax.

A loop that carries the complete transition state (user state, PRNG key, data
order, cursor, epoch, step), checkpoints it with Orbax's `CheckpointManager`,
restores it onto the current mesh, checks that every controller agrees, and
stops cleanly at a preemption step agreed by all controllers.

Modules, each importing only those above it (no cycle;
tests/test_recovery_layers.py reads this map):

  _quiet.py         binaries' filters for third-party lines that need no action
  _errors.py        every error recovery raises, and the advice its messages end with
  _state.py         the transition state and the epoch sampler
  _leaves.py        any state's leaves as Orbax stores them, and back into the
                    kinds of a target (Python scalars, uncommitted arrays, ...)
  _digest.py        host-side global values and digests of a state, by leaf path
  _consistency.py   the check that every controller holds an identical state
  _folder.py        what a checkpoint folder holds: this project's steps, linked
                    and foreign entries, crashed-save leftovers; what may be deleted
  _shared_folder.py the check that every process sees the checkpoint folder
  _lock.py          the run's exclusive, atomically taken lock on its folder
  _orbax.py         Orbax's CheckpointManager as used here: options, items,
                    watched calls, keep-N's deletes
  _meta.py          a checkpoint's meta item: what a save records, what a restore checks
  _local_folder.py  a host's local checkpoint folder: per-process steps, atomic writes
  _local_layout.py  where a state's blocks live: hosts, block keys, topology,
                    arrays assembled from blocks
  _local_restore.py the local tier's restore: the newest complete local step that
                    passes its checks, older ones next, blocks fetched from peers
  _local.py         the local tier: each host saves what it holds, peer copies,
                    the inventory of local steps across hosts
  _resume.py        how a run begins: resume modes, restarts read from the
                    environment, the tier and step, the fallback
  _checkpoint.py    Checkpoints: open, save, keep-N, restore and start in one folder
                    (and its local tier)
  _signals.py       the loop's SIGTERM and Ctrl-C handlers
  _loop.py          the resilient training loop
  _replay.py        the check that a restored run replays the uninterrupted one
"""

from recovery._checkpoint import Checkpoints as Checkpoints
from recovery._consistency import check_consistent as check_consistent
from recovery._digest import checkpoint_digest as checkpoint_digest
from recovery._digest import checkpoint_leaf_digests as checkpoint_leaf_digests
from recovery._digest import host_tree as host_tree
from recovery._digest import host_value as host_value
from recovery._errors import CheckpointCorruptError as CheckpointCorruptError
from recovery._errors import CheckpointError as CheckpointError
from recovery._errors import CheckpointFolderError as CheckpointFolderError
from recovery._errors import CheckpointMismatchError as CheckpointMismatchError
from recovery._errors import FolderNotFreshError as FolderNotFreshError
from recovery._errors import NothingToResumeError as NothingToResumeError
from recovery._errors import ReplayMismatchError as ReplayMismatchError
from recovery._errors import StepCheckError as StepCheckError
from recovery._local import HOST_ID_VARIABLE as HOST_ID_VARIABLE
from recovery._loop import ResilientLoop as ResilientLoop
from recovery._loop import RunResult as RunResult
from recovery._loop import StepRecord as StepRecord
from recovery._orbax import quiet_orbax_logs as quiet_orbax_logs
from recovery._quiet import cpp_warnings_hidden as cpp_warnings_hidden
from recovery._quiet import quiet_third_party_noise as quiet_third_party_noise
from recovery._replay import ATOL as ATOL
from recovery._replay import RTOL as RTOL
from recovery._replay import ReplayStep as ReplayStep
from recovery._replay import Stepper as Stepper
from recovery._replay import verify_replay as verify_replay
from recovery._resume import IF_PRESENT as IF_PRESENT
from recovery._resume import RESTART_COUNT_VARIABLES as RESTART_COUNT_VARIABLES
from recovery._state import EpochSampler as EpochSampler
from recovery._state import TransitionState as TransitionState
