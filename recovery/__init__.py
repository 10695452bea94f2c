"""recovery: resilient multi-controller training built on `multihost` and Orbax.

A loop that carries the complete transition state (user state, PRNG key, data
order, cursor, epoch, step), checkpoints it with Orbax's `CheckpointManager`,
restores it onto the current mesh, checks that every controller agrees, and
stops cleanly at a preemption step agreed by all controllers.

Modules, each importing only those above it (no cycle):

  _errors.py       every error recovery raises, and the advice its messages end with
  _state.py        the transition state and the epoch sampler
  _leaves.py       any state's leaves as Orbax stores them, and back into the
                   kinds of a target (Python scalars, uncommitted arrays, ...)
  _digest.py       host-side global values and digests of a state, by leaf path
  _consistency.py  the check that every controller holds an identical state
  _checkpoint.py   Orbax save/restore of states onto the current mesh
  _signals.py      the loop's SIGTERM and Ctrl-C handlers
  _loop.py         the resilient training loop
  _replay.py       the check that a restored run replays the uninterrupted one
"""

from recovery._checkpoint import (
    Checkpoints as Checkpoints,
    quiet_orbax_logs as quiet_orbax_logs,
)
from recovery._consistency import (
    check_consistent as check_consistent,
)
from recovery._digest import (
    checkpoint_leaf_digests as checkpoint_leaf_digests,
    host_tree as host_tree,
    host_value as host_value,
    state_digest as state_digest,
)
from recovery._errors import (
    CheckpointCorruptError as CheckpointCorruptError,
    CheckpointError as CheckpointError,
    ReplayMismatchError as ReplayMismatchError,
    StepCheckError as StepCheckError,
)
from recovery._loop import (
    ResilientLoop as ResilientLoop,
    RunResult as RunResult,
    StepRecord as StepRecord,
)
from recovery._replay import (
    ATOL as ATOL,
    RTOL as RTOL,
    ReplayStep as ReplayStep,
    Stepper as Stepper,
    verify_replay as verify_replay,
)
from recovery._state import (
    EpochSampler as EpochSampler,
    TransitionState as TransitionState,
)
