"""recovery: resilient multi-controller training built on `multihost` and Orbax.

A loop that carries the complete transition state (user state, PRNG key, data
order, cursor, epoch, step), checkpoints it with Orbax's `CheckpointManager`,
restores it onto the current mesh, checks that every controller agrees, and
stops cleanly at a preemption step agreed by all controllers.

The implementation lives in private packages under `recovery/_src/`, top to
bottom: `run` (the loop, its signals, replay, quiet logs), `checkpoint` (the
persistent tier: `Checkpoints`, Orbax, the folder and its lock, resume),
`local` (the local tier and peer copies), `state` (the transition state,
its leaves, digests, the consistency check, errors). Imports run one way
between them (recovery/_src/__init__.py's LAYERS, checked by
tests/unit/test_layers.py); this module only re-exports.
"""

from recovery._src.checkpoint.checkpoints import Checkpoints as Checkpoints
from recovery._src.checkpoint.damage import SetAside as SetAside
from recovery._src.checkpoint.manager import (
    quiet_orbax_logs as quiet_orbax_logs,
)
from recovery._src.checkpoint.resume import IF_PRESENT as IF_PRESENT
from recovery._src.checkpoint.resume import (
    RESTART_COUNT_VARIABLES as RESTART_COUNT_VARIABLES,
)
from recovery._src.local.tier import HOST_ID_VARIABLE as HOST_ID_VARIABLE
from recovery._src.run.loop import ResilientLoop as ResilientLoop
from recovery._src.run.loop import RunResult as RunResult
from recovery._src.run.loop import StepRecord as StepRecord
from recovery._src.run.quiet import cpp_warnings_hidden as cpp_warnings_hidden
from recovery._src.run.quiet import (
    quiet_third_party_noise as quiet_third_party_noise,
)
from recovery._src.run.replay import ATOL as ATOL
from recovery._src.run.replay import RTOL as RTOL
from recovery._src.run.replay import ReplayStep as ReplayStep
from recovery._src.run.replay import Stepper as Stepper
from recovery._src.run.replay import verify_replay as verify_replay
from recovery._src.state.consistency import check_consistent as check_consistent
from recovery._src.state.digest import checkpoint_digest as checkpoint_digest
from recovery._src.state.digest import (
    checkpoint_leaf_digests as checkpoint_leaf_digests,
)
from recovery._src.state.digest import host_tree as host_tree
from recovery._src.state.digest import host_value as host_value
from recovery._src.state.errors import (
    CheckpointCorruptError as CheckpointCorruptError,
)
from recovery._src.state.errors import (
    CheckpointDamagedError as CheckpointDamagedError,
)
from recovery._src.state.errors import CheckpointError as CheckpointError
from recovery._src.state.errors import (
    CheckpointFolderError as CheckpointFolderError,
)
from recovery._src.state.errors import (
    CheckpointMismatchError as CheckpointMismatchError,
)
from recovery._src.state.errors import (
    FolderNotFreshError as FolderNotFreshError,
)
from recovery._src.state.errors import (
    NothingToResumeError as NothingToResumeError,
)
from recovery._src.state.errors import (
    ReplayMismatchError as ReplayMismatchError,
)
from recovery._src.state.errors import StepCheckError as StepCheckError
from recovery._src.state.state import EpochSampler as EpochSampler
from recovery._src.state.state import TransitionState as TransitionState
