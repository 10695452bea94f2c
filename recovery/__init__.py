"""recovery: resilient multi-controller training built on `multihost` and Orbax.

A loop that carries the complete transition state (user state, PRNG key, data
order, cursor, epoch, step), checkpoints it with Orbax's `CheckpointManager`,
restores it onto the current mesh, checks that every controller agrees, and
stops cleanly at a preemption step agreed by all controllers.
"""

from recovery._checkpoint import (
    CheckpointCorruptError as CheckpointCorruptError,
    CheckpointError as CheckpointError,
    Checkpoints as Checkpoints,
    quiet_orbax_logs as quiet_orbax_logs,
)
from recovery._digest import (
    host_tree as host_tree,
    host_value as host_value,
    leaf_digests as leaf_digests,
    state_digest as state_digest,
)
from recovery._loop import (
    ResilientLoop as ResilientLoop,
    RunResult as RunResult,
    StepCheckError as StepCheckError,
    StepRecord as StepRecord,
)
from recovery._state import (
    EpochSampler as EpochSampler,
    TransitionState as TransitionState,
)
from recovery._verify import (
    ATOL as ATOL,
    RTOL as RTOL,
    ReplayMismatchError as ReplayMismatchError,
    ReplayStep as ReplayStep,
    check_consistent as check_consistent,
    verify_replay as verify_replay,
)
