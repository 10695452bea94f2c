"""bin/train.py's flags, and its fault drill (a module of that binary, not one itself).

`python bin/train.py` puts bin/ first on sys.path, so train.py imports
this module as `_train_flags`.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

from absl import flags

STEPS = flags.DEFINE_integer('steps', 20, 'Train until this step.',
                              lower_bound=1)
CHECKPOINT_DIR = flags.DEFINE_string(
    'checkpoint_dir', '',
    'Checkpoint folder, shared by all processes. Default (single controller '
    'only): a fresh temporary folder, whose path is printed.')
SAVE_EVERY = flags.DEFINE_integer('save_every', 5, 'Save every N steps.',
                                   lower_bound=1)
KEEP = flags.DEFINE_integer('keep', 3, 'Keep the last K checkpoints.',
                             lower_bound=1)
RESUME = flags.DEFINE_boolean(
    'resume', False,
    'Continue from the latest checkpoint in --checkpoint_dir (an error if '
    'there is none). --noresume: start fresh (an error if the folder holds a '
    'checkpoint). Without either, a folder that holds a checkpoint is an '
    'error, except on a restart or requeue ($MULTIHOST_RESTART_COUNT or '
    '$SLURM_RESTART_COUNT above 0), which resumes if present.')
RESUME_IF_PRESENT = flags.DEFINE_boolean(
    'resume_if_present', False,
    'Continue from the latest checkpoint in --checkpoint_dir if there is '
    'one, else start fresh.')
VERIFY_REPLAY = flags.DEFINE_integer(
    'verify_replay', 0,
    'After training, restore the last checkpoint and check that K more steps '
    'from it replay the uninterrupted run (ids, losses, state). 0: off.',
    lower_bound=0)
WIDTH = flags.DEFINE_integer('width', 8, 'Number of model weights.',
                              lower_bound=1)
SAMPLES = flags.DEFINE_integer('samples', 64, 'Number of training samples.',
                                lower_bound=1)
BATCH_SIZE = flags.DEFINE_integer(
    'batch_size', 8, 'Global batch size; a multiple of the device count.',
    lower_bound=1)
SEED = flags.DEFINE_integer('seed', 17, 'Seed of the data-order PRNG key.')
METRICS_OUT = flags.DEFINE_string(
    'metrics_out', '',
    'Process 0 writes one JSON object per step: step, loss, ids (the sample '
    'ids of the batch), digest (of the state after the step). --resume '
    'appends to the file.')
NUM_CPU_DEVICES = flags.DEFINE_integer(
    'num_cpu_devices', 4,
    'Virtual CPU devices per process when $JAX_NUM_CPU_DEVICES is unset.',
    lower_bound=1)
HANDLE_SIGTERM = flags.DEFINE_boolean(
    'handle_sigterm', True,
    'Single controller: on SIGTERM save and exit 0, as multi-controller runs '
    'do. False: SIGTERM kills the process (its default action).')
ASYNC_SAVE = flags.DEFINE_boolean('async_save', True,
                                   'Commit checkpoints in the background.')
PROGRESS_EVERY = flags.DEFINE_float(
    'progress_every', 5.0, 'Seconds between progress lines (step, loss, '
    'steps/s).')
STRAGGLER_EVERY = flags.DEFINE_integer(
    'straggler_every', 100, 'Every this many steps, compare when the '
    'processes arrived at their recent collectives '
    '(multihost.straggler_report) and log one line when one process is '
    'consistently last (0: never).', lower_bound=0)

LOCAL_DIR = flags.DEFINE_string(
    'local_checkpoint_dir', '',
    'Host-local folder of the local checkpoint tier (the same path on every '
    'host, each on its own disk; e.g. a RAM disk): every --local_save_every '
    'steps each process writes the blocks it holds there, blocks held by one '
    'host only are copied to a peer host, and a restart restores the newest '
    'step complete across the hosts when it is at least as new as the '
    'persistent one. Hosts are told apart by hostname, or by '
    '$RECOVERY_HOST_ID. Empty: no local tier.')
LOCAL_SAVE_EVERY = flags.DEFINE_integer(
    'local_save_every', 0, 'Local tier: save every K steps (0: '
    '--save_every).', lower_bound=0)
SHARD_PARAMS = flags.DEFINE_boolean(
    'shard_params', False,
    'Shard the weights and momentum over all devices (--width must be a '
    'multiple of the device count), so that no process holds the whole '
    'state.')
DRILL_KILL_AFTER = flags.DEFINE_integer(
    'drill_kill_after_step', 0,
    'For fault drills: on the first attempt ($MULTIHOST_RESTART_COUNT unset '
    'or 0), process --drill_kill_process SIGKILLs itself after this step, '
    'before its saves (0: never).', lower_bound=0)
DRILL_KILL_PROCESS = flags.DEFINE_integer(
    'drill_kill_process', 1, 'For fault drills: the process that is killed.',
    lower_bound=0)
DRILL_WIPE_LOCAL = flags.DEFINE_boolean(
    'drill_wipe_local', False,
    'For fault drills: the killed process first deletes its host\'s '
    '--local_checkpoint_dir (a replaced host).')

ORBAX_INFO = flags.DEFINE_boolean(
    'orbax_info_logs', False, 'Show Orbax\'s INFO log lines (many per save).')


# The flags every process must agree on: they shape the model, the data order,
# the schedule of saves and collectives, or the checkpoint folder. The others
# may differ: --local_checkpoint_dir's path (each host its own; only whether
# there is one must agree), --metrics_out (process 0 writes it), the logging
# flags, --num_cpu_devices and --handle_sigterm (this process's own).
_MUST_AGREE = (STEPS, CHECKPOINT_DIR, SAVE_EVERY, KEEP, RESUME,
               RESUME_IF_PRESENT, VERIFY_REPLAY, WIDTH, SAMPLES, BATCH_SIZE,
               SEED, ASYNC_SAVE, STRAGGLER_EVERY, LOCAL_SAVE_EVERY,
               SHARD_PARAMS, DRILL_KILL_AFTER, DRILL_KILL_PROCESS,
               DRILL_WIPE_LOCAL)


def must_agree() -> dict[str, object]:
  """{'--flag': value} of the flags every process must agree on, and whether --resume and --local_checkpoint_dir were given."""
  values: dict[str, object] = {f'--{f.name}': f.value for f in _MUST_AGREE}
  values['whether --resume was given'] = RESUME.present
  values['whether --local_checkpoint_dir is set'] = bool(LOCAL_DIR.value)
  return values


def drill(step: int, pid: int, *, first_attempt: bool) -> None:
  """The fault drill: process --drill_kill_process SIGKILLs itself after --drill_kill_after_step, on the first attempt only."""
  if (step == DRILL_KILL_AFTER.value and first_attempt
      and pid == DRILL_KILL_PROCESS.value):
    if DRILL_WIPE_LOCAL.value and LOCAL_DIR.value:
      shutil.rmtree(LOCAL_DIR.value, ignore_errors=True)
    print(f'Drill: process {pid} SIGKILLs itself after step {step} '
          f'at {time.time():.3f}.', flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
