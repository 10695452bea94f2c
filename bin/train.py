"""The main job: resilient multi-controller training of a linear regression.

Trains the tutorial's example (least squares, momentum SGD) with the
`recovery` loop: deterministic per-epoch data order carried in the state,
Orbax checkpoints every --save_every steps, consistency checks across
controllers, and a clean stop on preemption (SIGTERM). Every step is checked
against an independent host-side computation, while the next step computes
(`overlap_check`).

Single controller (no flags: 4 virtual CPU devices, a fresh checkpoint folder):
  python bin/train.py
Several controllers on this machine:
  python -m multihost.launch --num_processes=2 --devices_per_process=2 -- \
      python bin/train.py --checkpoint_dir=/tmp/ckpt --steps=200
Continue after a preemption (same or another topology):
  python bin/train.py --checkpoint_dir=/tmp/ckpt --steps=200 --resume
Resume if there is a checkpoint, else start fresh (for jobs a scheduler
requeues; the default on a restart or requeue); a damaged newest checkpoint
is then set aside and the previous one resumed:
  python bin/train.py --checkpoint_dir=/tmp/ckpt --steps=200 --resume_if_present

Exit status 78 (`multihost.env.NO_RETRY_EXIT_STATUS`) says that restarting
will not help, so that `multihost.launch --max_restarts` and
docs/restart.sbatch stop: bad flags or usage, flags that differ across the
processes, and a checkpoint that is required and missing or unusable (when
the run starts: nothing to resume from, a folder that is not fresh, a
checkpoint of another model or a damaged one, one beyond --steps).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import _train_flags as F  # bin/_train_flags.py: the flags, the drill.
from _train_model import LinearRegression  # bin/_train_model.py
from absl import app
from absl import flags
from absl import logging
import jax

import multihost
import recovery

# Restarting will not help (see the module's docstring).
NO_RETRY = multihost.env.NO_RETRY_EXIT_STATUS


class UsageError(app.UsageError):
  """Bad flags or usage: absl prints the usage, the process exits with NO_RETRY."""

  def __init__(self, message: str):
    super().__init__(message, exitcode=NO_RETRY)


def _resume_mode() -> bool | str | None:
  """recovery's resume mode from --resume / --noresume / --resume_if_present."""
  if F.RESUME_IF_PRESENT.value:
    if F.RESUME.present:
      raise UsageError(
          '--resume_if_present cannot be combined with --resume or '
          '--noresume; pass one of them.')
    return recovery.IF_PRESENT
  # Not given: recovery's default (fresh, or resume if present on a restart).
  return F.RESUME.value if F.RESUME.present else None


def _fail(message: str, code: int = 2) -> None:
  # One line, on stderr (where absl's log lines go too).
  if code == NO_RETRY:
    message += (f' (Exit status {NO_RETRY}: restarting will not help; a '
                'launcher with restarts stops here.)')
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(code)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, except that bad flags exit with NO_RETRY (restarting will not help)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.stderr.write(f'FATAL Flags parsing error: {e}\nPass --helpshort or '
                     f'--helpfull to see help on flags. (Exit status '
                     f'{NO_RETRY}: restarting will not help.)\n')
    sys.exit(NO_RETRY)


def _check_same_flags(prefix: str) -> None:
  """Exits with NO_RETRY on every process unless all run with the same training flags (collective)."""
  mine = F.must_agree()
  everyone = multihost.allgather_object(mine)
  differ = [name for name in mine
            if any(other.get(name) != mine[name] for other in everyone)]
  if not differ:
    return
  values = '; '.join(
      f'{name}: ' + ', '.join(f'p{i}={other.get(name)!r}'
                                for i, other in enumerate(everyone))
      for name in differ)
  error = multihost.ConsistencyError(
      f'the processes run with different flags: {values}. Every process '
      'must get the same training flags (only --local_checkpoint_dir\'s '
      'path, --metrics_out and the logging flags may differ); fix the '
      'command and run again.')
  _fail(f'{prefix} {type(error).__name__}: {error}', code=NO_RETRY)


def _start_multihost() -> None:
  """Quiets the logs, sets the CPU devices, initializes multihost and its step deadline."""
  if not F.ORBAX_INFO.value:
    recovery.quiet_orbax_logs()
  recovery.quiet_third_party_noise()
  if multihost.env.NUM_CPU_DEVICES not in os.environ:
    jax.config.update('jax_num_cpu_devices', F.NUM_CPU_DEVICES.value)
  multihost.initialize()
  rule = F.step_deadline_rule()
  if rule is not None:
    multihost.set_step_deadline(**rule)


def _checked_batch_size(count: int) -> int:
  """--batch_size, once it fits `count` devices and --samples."""
  batch_size = F.BATCH_SIZE.value
  if batch_size % count:
    raise UsageError(
        f'--batch_size={batch_size} must be a multiple of the device count '
        f'({count}), since the batch is sharded over all devices.')
  if batch_size > F.SAMPLES.value:
    raise UsageError(
        f'--batch_size={batch_size} exceeds --samples={F.SAMPLES.value}.')
  return batch_size


def _checkpoint_folder() -> str:
  """--checkpoint_dir, or (one process, no --resume) a new temporary folder."""
  directory = F.CHECKPOINT_DIR.value
  if directory:
    return directory
  if jax.process_count() > 1:
    raise UsageError(
        'A multi-controller run needs --checkpoint_dir, a folder shared by '
        'every process.')
  if F.RESUME.value:
    raise UsageError('--resume needs --checkpoint_dir.')
  return tempfile.mkdtemp(prefix='multihost-train-')


def _check_tier_and_sharding(count: int) -> None:
  """The local tier's flags go together; sharded parameters fit `count` devices."""
  if F.LOCAL_SAVE_EVERY.value and not F.LOCAL_DIR.value:
    raise UsageError(
        f'--local_save_every={F.LOCAL_SAVE_EVERY.value} needs '
        '--local_checkpoint_dir (the host-local folder of the local tier).')
  if F.SHARD_PARAMS.value and F.WIDTH.value % count:
    raise UsageError(
        f'--shard_params needs --width={F.WIDTH.value} to be a multiple of the '
        f'device count ({count}).')


def _checkpoints(directory: str) -> recovery.Checkpoints:
  """The run's checkpoints in `directory`, as the flags say."""
  return recovery.Checkpoints(
      directory, save_every=F.SAVE_EVERY.value, keep=F.KEEP.value,
      async_save=F.ASYNC_SAVE.value, read_once=F.READ_ONCE.value,
      local_directory=F.LOCAL_DIR.value or None,
      local_save_every=(F.LOCAL_SAVE_EVERY.value or None
                        if F.LOCAL_DIR.value else None))


class _Run:
  """One training run's loop, its per-step hook (metrics, straggler checks, drills) and its start and end."""

  def __init__(self, model: LinearRegression, *, pid: int, prefix: str):
    self.model, self.pid, self.prefix = model, pid, prefix
    self.attempt = int(os.environ.get(multihost.env.RESTART_COUNT) or 0)
    self.first_attempt = self.attempt == 0
    sampler = recovery.EpochSampler(F.SAMPLES.value, model.batch_size)
    self.upcoming = 0  # The step whose batch data_fn loads next.
    self.loop = recovery.ResilientLoop(model.update, data_fn=self._data,
                                       sampler=sampler, check_fn=model.check,
                                       overlap_check=True)
    self.initial = self.loop.init(model.initial_user_state(),
                                  jax.random.key(F.SEED.value))
    self.metrics = None
    self.checked = time.monotonic()  # When the straggler check last ran.
    # Set when the run resumed: the first step after it is announced.
    self.announce_first_step = False
    # Until training starts, a CheckpointError means no usable checkpoint
    # where the run needs one: every attempt would fail the same way.
    self.started = False
    self.checkpoints: recovery.Checkpoints | None = None

  def _data(self, ids):
    F.stall(self.upcoming, self.pid, first_attempt=self.first_attempt)
    return self.model.batch(ids)

  def on_step(self, state, record) -> None:
    """After each step: the resumed run's first step, the straggler check, the metrics, the drills."""
    pid, prefix = self.pid, self.prefix
    if self.announce_first_step:
      self.announce_first_step = False
      # Every process: when each one trains again (bench/restart_drill.py).
      print(f'{prefix} Training again: step {record.step} done at '
            f'{time.time():.3f}.', flush=True)
    every = F.STRAGGLER_EVERY.value
    if every and jax.process_count() > 1 and record.step % every == 0:
      report = multihost.straggler_report()  # Every process, same step.
      step_s, self.checked = ((time.monotonic() - self.checked) / every,
                              time.monotonic())
      if pid == 0 and report.matters(step_seconds=step_s):
        logging.warning('%s step %d: %s', prefix, record.step,
                        report.summary())
    if F.METRICS_OUT.value:
      digest = recovery.checkpoint_digest(state)  # Every process: may be collective.
      if self.metrics is not None:
        self._write({'step': record.step, 'loss': record.loss,
                     'ids': record.ids.tolist(), 'digest': digest})
        if record.step % F.SAVE_EVERY.value == 0:  # A save began (bin/plot.py).
          self._write({'event': 'save', 'step': record.step})
        self.metrics.flush()
    F.drill(record.step, pid, first_attempt=self.first_attempt,
            checkpoints=self.checkpoints)
    F.stall_between(record.step, pid, first_attempt=self.first_attempt)
    F.chaos(record.step, pid, attempt=self.attempt)
    self.upcoming = record.step + 1

  def _write(self, line: dict) -> None:
    self.metrics.write(json.dumps(line) + '\n')

  def start(self, checkpoints: recovery.Checkpoints, *, resume,
            directory: str):
    """The state training starts from (resumed, or the initial one); opens the metrics file and says where the run resumed."""
    self.checkpoints = checkpoints
    prefix = self.prefix
    state = checkpoints.start(self.initial, resume=resume)
    resumed = checkpoints.resumed_from is not None
    self.upcoming = state.step + 1
    if state.step > F.STEPS.value:
      raise recovery.CheckpointError(
          f'{prefix} The latest checkpoint in {directory} is at step '
          f'{state.step}, beyond --steps={F.STEPS.value}. Pass a larger '
          '--steps to continue training.')
    self.started = True
    self._open_metrics(state, resumed=resumed)
    if resumed:
      self.announce_first_step = True
      tier = checkpoints.resumed_tier
      peers = (checkpoints.local.restored_bytes_from_peers
               if tier == 'local' else 0)
      # Every process: the bytes each fetched from its peers differ.
      print(f'{prefix} Resumed from step {state.step} (epoch {state.epoch}) '
            f'from the {tier} tier, {peers} bytes from peers, at '
            f'{time.time():.3f}.', flush=True)
    return state

  def _open_metrics(self, state, *, resumed: bool) -> None:
    """Process 0's --metrics_out, with the resume and the set-aside steps marked (for bin/plot.py)."""
    if F.METRICS_OUT.value and self.pid == 0:
      try:
        # A resumed run continues the file; a fresh run starts it anew.
        self.metrics = open(F.METRICS_OUT.value, 'a' if resumed else 'w')
      except OSError as e:
        raise UsageError(
            f'--metrics_out={F.METRICS_OUT.value} cannot be opened for '
            f'writing: {e}') from e
    if self.metrics is None:
      return
    checkpoints = self.checkpoints
    if resumed:  # bin/plot.py marks it.
      restarted = int(os.environ.get(multihost.env.RESTART_COUNT) or 0) > 0
      self._write({'event': 'restart' if restarted else 'resume',
                   'step': state.step, 'tier': checkpoints.resumed_tier})
    for aside in checkpoints.set_aside:  # Each damaged folder renamed,
      self._write({'event': 'set_aside', 'step': aside.step,  # either tier.
                   'tier': aside.tier, 'moved_to': aside.path,
                   'resumed_from': state.step})

  def finish(self, result, *, directory: str, temporary: str | None) -> bool:
    """Says how the run ended and runs the replay check; False when it was preempted (its checkpoint folder is kept)."""
    pid, checkpoints = self.pid, self.checkpoints
    state = result.state
    digest = recovery.checkpoint_digest(state)
    last_loss = result.last_loss
    if result.preempted:
      if pid == 0:
        again = ('--resume' if temporary is None else
                 f'--checkpoint_dir={directory} --resume')
        print(f'Preempted: saved step {state.step} to {directory}; exiting '
              f'0. Relaunch with {again} to continue.', flush=True)
      return False
    if pid == 0:
      trained = ('nothing left to train' if last_loss is None
                 else f'last loss {last_loss}')
      print(f'Finished step {state.step} (epoch {state.epoch}) '
            f'digest {digest} checkpoints {checkpoints.steps()} '
            f'{trained}', flush=True)
    if F.VERIFY_REPLAY.value:
      restored = checkpoints.restore(self.initial, step=state.step)
      replay = recovery.verify_replay(self.loop, state, restored,
                                      F.VERIFY_REPLAY.value)
      if pid == 0:
        print(f'Replay check passed: {len(replay)} steps from checkpoint '
              f'step {state.step}: sample ids identical, losses and state '
              f'within rtol={recovery.RTOL}, atol={recovery.ATOL}.')
        print('Replay ids: ' + json.dumps([r.ids.tolist() for r in replay]))
        print('Replay losses: ' + json.dumps(
            [[r.reference_loss, r.replayed_loss] for r in replay]),
            flush=True)
    return True

  def close(self) -> None:
    if self.metrics is not None:
      self.metrics.close()


def main(argv):
  del argv  # Unused.
  _start_multihost()
  pid = jax.process_index()
  prefix = multihost.process_prefix()
  _check_same_flags(prefix)
  count = jax.device_count()
  batch_size = _checked_batch_size(count)
  directory = _checkpoint_folder()
  # Without --checkpoint_dir: removed when the run finishes, kept otherwise.
  temporary = None if F.CHECKPOINT_DIR.value else directory
  finished = False
  resume = _resume_mode()
  if pid == 0:
    print(f'Checkpoint folder: {directory}', flush=True)
  _check_tier_and_sharding(count)
  model = LinearRegression(jax.make_mesh((count,), ('data',)),
                           width=F.WIDTH.value, samples=F.SAMPLES.value,
                           batch_size=batch_size,
                           shard_params=F.SHARD_PARAMS.value)
  run = _Run(model, pid=pid, prefix=prefix)
  if pid == 0:  # The same on every process.
    logging.info('%s %d processes, %d devices, width=%d samples=%d batch=%d '
                 'lr=%g', prefix, jax.process_count(), count, F.WIDTH.value,
                 F.SAMPLES.value, batch_size, model.lr)
  try:
    with _checkpoints(directory) as checkpoints:
      state = run.start(checkpoints, resume=resume, directory=directory)
      result = run.loop.run(state, until_step=F.STEPS.value,
                            checkpoints=checkpoints, on_step=run.on_step,
                            handle_sigterm=F.HANDLE_SIGTERM.value,
                            progress_every_s=F.PROGRESS_EVERY.value)
      if not run.finish(result, directory=directory, temporary=temporary):
        return  # Preempted.
    finished = True
  except recovery.CheckpointError as e:
    _fail(f'{prefix} {type(e).__name__}: {e}{F.advice(e)}',
          code=2 if run.started else NO_RETRY)
  except (recovery.ReplayMismatchError, recovery.StepCheckError,
          multihost.ConsistencyError) as e:
    _fail(f'{prefix} {type(e).__name__}: {e}')
  except KeyboardInterrupt as e:
    # The loop's first note: the step reached and the last checkpoint.
    told = getattr(e, '__notes__', None)
    what = told[0] if told else f'{prefix} Interrupted (Ctrl-C).'
    _fail(f'{what} Committed checkpoints in {directory} are intact; '
          'relaunch with --resume_if_present to continue.', code=130)
  finally:
    run.close()
    if temporary is not None:
      _settle_temporary(temporary, finished=finished)


def _settle_temporary(directory: str, *, finished: bool) -> None:
  """The checkpoint folder made without --checkpoint_dir: removed after a finished run, else kept (said where and why: --resume continues from it)."""
  if finished:
    shutil.rmtree(directory, ignore_errors=True)
    print(f'Removed the temporary checkpoint folder {directory} (give '
          '--checkpoint_dir=DIR to keep the checkpoints).', flush=True)
  else:
    print(f'Kept the temporary checkpoint folder {directory}: the run did not '
          f'finish; continue it with --checkpoint_dir={directory} --resume, '
          'or remove the folder.', file=sys.stderr, flush=True)


if __name__ == '__main__':
  app.run(main, flags_parser=_parse_flags)
