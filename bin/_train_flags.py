"""bin/train.py's flags (and which of them fix an error), and its fault drills (a module of that binary, not one itself).

`python bin/train.py` puts bin/ first on sys.path, so train.py imports
this module as `_train_flags`.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import threading
import time

from absl import flags
import numpy as np

import recovery

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
READ_ONCE = flags.DEFINE_boolean(
    'read_once', True,
    'A persistent restore reads each replicated leaf from storage on one '
    'process and sends it to the others (recovery.Checkpoints(read_once=)). '
    'False: every process reads all it holds.')
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
    'persistent one. Processes that share the folder are one host (the '
    'folder keeps a random identity; hostnames do not count), unless '
    '$RECOVERY_HOST_ID says otherwise. Empty: no local tier.')
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
    'before its saves, once its local save still in flight (of an earlier '
    'step) is on disk, so that the drill\'s newest local step does not '
    'depend on the machine\'s load (0: never).', lower_bound=0)
DRILL_KILL_PROCESS = flags.DEFINE_integer(
    'drill_kill_process', 1, 'For fault drills: the process that is killed.',
    lower_bound=0)
DRILL_WIPE_LOCAL = flags.DEFINE_boolean(
    'drill_wipe_local', False,
    'For fault drills: the killed process first deletes its host\'s '
    '--local_checkpoint_dir (a replaced host).')
DRILL_DAMAGE_NEWEST = flags.DEFINE_boolean(
    'drill_damage_newest', False,
    'For fault drills: the killed process first overwrites the array data '
    'files of the newest committed step in --checkpoint_dir with random '
    'bytes (a damaged checkpoint), so that the restart must set it aside '
    'and resume from the previous one. With --noasync_save, every save due '
    'by then has committed.')
DRILL_DAMAGE_NEWEST_LOCAL = flags.DEFINE_boolean(
    'drill_damage_newest_local', False,
    'For fault drills: the killed process first flips the last byte of the '
    'data file of its newest local step in --local_checkpoint_dir (a damaged '
    'local step), so that the restart must set that step aside and restore '
    'an older one.')

DRILL_STALL_AT = flags.DEFINE_integer(
    'drill_stall_at_step', 0,
    'For fault drills: on the first attempt ($MULTIHOST_RESTART_COUNT unset '
    'or 0), process --drill_stall_process sleeps --drill_stall_seconds in '
    'its data loader of this step (alive, but stuck: the step deadline ends '
    'it; 0: never).', lower_bound=0)
DRILL_STALL_BETWEEN = flags.DEFINE_integer(
    'drill_stall_between_steps_at', 0,
    'For fault drills: on the first attempt ($MULTIHOST_RESTART_COUNT unset '
    'or 0), process --drill_stall_process blocks its main thread for '
    '--drill_stall_seconds in a SIGUSR2 handler, raised in its per-step '
    'callback after this step (between steps, alive and heartbeating: the '
    'step deadline ends it; 0: never).', lower_bound=0)
DRILL_FAULTS = flags.DEFINE_string(
    'drill_faults', '',
    'For chaos drills: faults, each ATTEMPT:KIND:PROCESS:STEP, comma-'
    'separated: on attempt ATTEMPT ($MULTIHOST_RESTART_COUNT, 0 first), '
    'process PROCESS, after step STEP: KIND kill (SIGKILL itself), stop '
    '(SIGSTOP itself: alive to the kernel, silent to its peers) or stall '
    '(its main thread blocks in a SIGUSR2 handler, signalled from a thread '
    'a moment after the step: wherever the loop\'s code is then).')
DRILL_STALL_PROCESS = flags.DEFINE_integer(
    'drill_stall_process', 1, 'For fault drills: the process that stalls.',
    lower_bound=0)
DRILL_STALL_SECONDS = flags.DEFINE_float(
    'drill_stall_seconds', 3600.0,
    'For fault drills: how long the stalled process sleeps.', lower_bound=0)


def _deadline_ok(value: str) -> bool:
  """Whether --step_deadline is auto, off or a positive number."""
  value = value.strip().lower()
  if value in ('auto', 'off'):
    return True
  try:
    return float(value) > 0
  except ValueError:
    return False


STEP_DEADLINE = flags.DEFINE_string(
    'step_deadline', 'auto',
    'How long a training step may take before every process leaves with '
    'exit status 75, naming the process behind (multihost.set_step_deadline):'
    ' auto (learned: after --step_deadline_warmup steps, max('
    '--step_deadline_floor, --step_deadline_multiple x the longest step)), '
    'off, or a fixed number of seconds. Without any --step_deadline* flag: '
    '$MULTIHOST_STEP_DEADLINE, else auto.')
flags.register_validator(
    'step_deadline', _deadline_ok,
    message='--step_deadline must be auto, off or a positive number of '
    'seconds.')
STEP_DEADLINE_WARMUP = flags.DEFINE_integer(
    'step_deadline_warmup', 3, 'auto: the first steps, never judged '
    '(compilation).', lower_bound=0)
STEP_DEADLINE_MULTIPLE = flags.DEFINE_float(
    'step_deadline_multiple', 5.0, 'auto: a step may take this many times '
    'the longest step seen.', lower_bound=1)
STEP_DEADLINE_FLOOR = flags.DEFINE_float(
    'step_deadline_floor', 60.0, 'auto: a step always gets at least this '
    'many seconds.', lower_bound=0.001)

ORBAX_INFO = flags.DEFINE_boolean(
    'orbax_info_logs', False, 'Show Orbax\'s INFO log lines (many per save).')


def step_deadline_rule() -> dict[str, object] | None:
  """`multihost.set_step_deadline`'s arguments from the --step_deadline* flags; None when none is given."""
  given = (STEP_DEADLINE, STEP_DEADLINE_WARMUP, STEP_DEADLINE_MULTIPLE,
           STEP_DEADLINE_FLOOR)
  if not any(flag.present for flag in given):
    return None
  value = STEP_DEADLINE.value.strip().lower()
  if value == 'off':
    return {'enabled': False}
  rule = {'warmup_steps': STEP_DEADLINE_WARMUP.value,
          'multiple': STEP_DEADLINE_MULTIPLE.value,
          'floor': STEP_DEADLINE_FLOOR.value}
  if value != 'auto':
    rule['fixed'] = float(value)
  return rule


def stall(step: int, pid: int, *, first_attempt: bool) -> None:
  """The stall drill: process --drill_stall_process sleeps in its data loader of step --drill_stall_at_step, on the first attempt only."""
  if (step == DRILL_STALL_AT.value and first_attempt
      and pid == DRILL_STALL_PROCESS.value):
    print(f'Drill: process {pid} stalls in its data loader of step {step} '
          f'for {DRILL_STALL_SECONDS.value:g} s at {time.time():.3f}.',
          flush=True)
    time.sleep(DRILL_STALL_SECONDS.value)


def _faults_ok(value: str) -> bool:
  """Whether --drill_faults is a list of ATTEMPT:KIND:PROCESS:STEP."""
  try:
    _faults(value)
  except ValueError:
    return False
  return True


def _faults(value: str) -> list[tuple[int, str, int, int]]:
  out = []
  for item in filter(None, value.split(',')):
    attempt, kind, process, step = item.split(':')
    if kind not in ('kill', 'stop', 'stall'):
      raise ValueError(kind)
    out.append((int(attempt), kind, int(process), int(step)))
  return out


flags.register_validator(
    'drill_faults', _faults_ok,
    message='--drill_faults must be ATTEMPT:KIND:PROCESS:STEP items (KIND '
    'kill, stop or stall), comma-separated.')


def chaos(step: int, pid: int, *, attempt: int) -> None:
  """The chaos drill: this attempt's --drill_faults of process `pid` after `step`."""
  for at, kind, process, when in _faults(DRILL_FAULTS.value):
    if (at, process, when) != (attempt, pid, step):
      continue
    print(f'Drill: process {pid} on attempt {attempt}: {kind} after step '
          f'{step} at {time.time():.3f}.', flush=True)
    if kind == 'stall':
      _stall_in_handler(step, pid)
    else:
      os.kill(os.getpid(), signal.SIGKILL if kind == 'kill' else
              signal.SIGSTOP)


def stall_between(step: int, pid: int, *, first_attempt: bool) -> None:
  """The drill of a stall between steps: after step --drill_stall_between_steps_at, process --drill_stall_process's main thread blocks in a SIGUSR2 handler (first attempt only)."""
  if (step == DRILL_STALL_BETWEEN.value and first_attempt
      and pid == DRILL_STALL_PROCESS.value):
    _stall_in_handler(step, pid, at_once=True)


def _stall_in_handler(step: int, pid: int, *, at_once: bool = False) -> None:
  """Blocks the main thread for --drill_stall_seconds in a SIGUSR2 handler: signalled here (`at_once`: in this callback, between steps), else a moment later from a thread (wherever the loop's code is then)."""

  def handler(signum, frame):
    del signum
    print(f'Drill: process {pid} stalls in a signal handler after step '
          f'{step} (in {frame.f_code.co_name}) for '
          f'{DRILL_STALL_SECONDS.value:g} s at {time.time():.3f}.',
          flush=True)
    time.sleep(DRILL_STALL_SECONDS.value)

  signal.signal(signal.SIGUSR2, handler)
  if at_once:
    signal.raise_signal(signal.SIGUSR2)
    return
  # From another thread, a moment later: the main thread runs the handler
  # at whatever point of the loop's code it has reached by then.
  threading.Timer(0.005, os.kill, (os.getpid(), signal.SIGUSR2)).start()


# The flags every process must agree on: they shape the model, the data order,
# the schedule of saves and collectives, or the checkpoint folder. The others
# may differ: --local_checkpoint_dir's path (each host its own; only whether
# there is one must agree), --metrics_out (process 0 writes it), the logging
# flags, --num_cpu_devices and --handle_sigterm (this process's own).
_MUST_AGREE = (STEPS, CHECKPOINT_DIR, SAVE_EVERY, KEEP, RESUME,
               RESUME_IF_PRESENT, VERIFY_REPLAY, WIDTH, SAMPLES, BATCH_SIZE,
               SEED, ASYNC_SAVE, READ_ONCE, STRAGGLER_EVERY, LOCAL_SAVE_EVERY,
               SHARD_PARAMS, DRILL_KILL_AFTER, DRILL_KILL_PROCESS,
               DRILL_WIPE_LOCAL, DRILL_DAMAGE_NEWEST,
               DRILL_DAMAGE_NEWEST_LOCAL, DRILL_STALL_AT,
               DRILL_STALL_BETWEEN, DRILL_FAULTS,
               DRILL_STALL_PROCESS, DRILL_STALL_SECONDS, STEP_DEADLINE,
               STEP_DEADLINE_WARMUP, STEP_DEADLINE_MULTIPLE,
               STEP_DEADLINE_FLOOR)


def must_agree() -> dict[str, object]:
  """{'--flag': value} of the flags every process must agree on, and whether --resume and --local_checkpoint_dir were given."""
  values: dict[str, object] = {f'--{f.name}': f.value for f in _MUST_AGREE}
  values['whether --resume was given'] = RESUME.present
  values['whether --local_checkpoint_dir is set'] = bool(LOCAL_DIR.value)
  return values


def drill(step: int, pid: int, *, first_attempt: bool, checkpoints) -> None:
  """The fault drill: process --drill_kill_process SIGKILLs itself after --drill_kill_after_step, on the first attempt only."""
  if (step == DRILL_KILL_AFTER.value and first_attempt
      and pid == DRILL_KILL_PROCESS.value):
    # A local step still being written in the background finishes first: the
    # drill's newest local step is then the same on a loaded machine (and is
    # not committed into a folder the drill wipes below).
    if checkpoints.local is not None:
      checkpoints.local.wait()
    if DRILL_WIPE_LOCAL.value and LOCAL_DIR.value:
      shutil.rmtree(LOCAL_DIR.value, ignore_errors=True)
    if DRILL_DAMAGE_NEWEST.value:
      _damage_newest(checkpoints.directory)
    if DRILL_DAMAGE_NEWEST_LOCAL.value and checkpoints.local is not None:
      _damage_newest_local(checkpoints.local, pid)
    print(f'Drill: process {pid} SIGKILLs itself after step {step} '
          f'at {time.time():.3f}.', flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _damage_newest_local(tier, pid: int) -> None:
  """Flips the last byte of `data.bin` of process `pid`'s newest local step of this run (`<local>/process_<pid>/<step>-<run>/`), its write finished."""
  own = pathlib.Path(tier.local) / f'process_{pid}'
  data = own / f'{tier.last_saved}-{tier.run}' / 'data.bin'
  if tier.last_saved is None or not data.is_file():
    raise AssertionError(f'--drill_damage_newest_local: no local step of '
                         f'this run in {own} yet; kill after a later step.')
  raw = bytearray(data.read_bytes())
  raw[-1] ^= 0xff
  data.write_bytes(bytes(raw))
  print(f'Drill: damaged local step {tier.last_saved} in {own} at '
        f'{time.time():.3f}.', flush=True)


def _damage_newest(directory: str) -> None:
  """Overwrites the array data files (`state/**/d/*`) of the newest committed step with random bytes."""
  steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit())
  if not steps:
    raise AssertionError(f'--drill_damage_newest: no committed step in '
                         f'{directory} yet; kill after a later step, or save '
                         'sooner (--save_every, --noasync_save).')
  files = [f for f in (pathlib.Path(directory) / str(steps[-1])).rglob('*')
           if f.is_file() and f.parent.name == 'd']
  for f in files:
    f.write_bytes(np.random.default_rng(0).bytes(f.stat().st_size))
  print(f'Drill: damaged step {steps[-1]} in {directory} ({len(files)} data '
        f'files overwritten) at {time.time():.3f}.', flush=True)


def advice(e: recovery.CheckpointError) -> str:
  """This binary's flags for the fix a recovery error describes."""
  if isinstance(e, recovery.NothingToResumeError):
    return (' Here: run without --resume for a fresh run, or with '
            '--resume_if_present.')
  if isinstance(e, recovery.FolderNotFreshError):
    return (' Here: pass --resume (or --resume_if_present) to continue, or '
            'a new --checkpoint_dir.')
  if isinstance(e, recovery.CheckpointMismatchError):
    return (' Here: resume with the --width and --samples that made it, or '
            'pass a new --checkpoint_dir.')
  if isinstance(e, recovery.CheckpointFolderError):
    return ' Here: pass another --checkpoint_dir.'
  if (isinstance(e, recovery.CheckpointDamagedError)
      and f"resume='{recovery.IF_PRESENT}'" in str(e)):
    return ' Here: pass --resume_if_present instead of --resume.'
  return ''
