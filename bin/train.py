"""The main job: resilient multi-controller training of a linear regression.

Trains the tutorial's example (least squares, momentum SGD) with the
`recovery` loop: deterministic per-epoch data order carried in the state,
Orbax checkpoints every --save_every steps, consistency checks across
controllers, and a clean stop on preemption (SIGTERM). Every step is checked
against an independent host-side computation.

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

import functools
import json
import math
import os
import shutil
import sys
import tempfile
import time

import _train_flags as F  # bin/_train_flags.py: the flags, the drill.
from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

import multihost
from multihost import lowlevel
import recovery

BASE_LR = 0.04
MOMENTUM = 0.8
# Restarting will not help (see the module's docstring).
NO_RETRY = multihost.env.NO_RETRY_EXIT_STATUS


class UsageError(app.UsageError):
  """Bad flags or usage: absl prints the usage, the process exits with NO_RETRY."""

  def __init__(self, message: str):
    super().__init__(message, exitcode=NO_RETRY)


def learning_rate(width: int, batch_size: int) -> float:
  """The tutorial's 0.04, scaled down so that momentum SGD stays stable.

  The largest curvature of the batch loss grows like (1 + sqrt(width /
  batch))^2 for Gaussian data; the tutorial's size (width == batch) gets 0.04.
  """
  return BASE_LR * min(1.0, 4.0 / (1.0 + math.sqrt(width / batch_size))**2)


class LinearRegression:
  """The tutorial's fixture: data, targets, jitted step and its host check."""

  def __init__(self, mesh: jax.sharding.Mesh, *, width: int, samples: int,
               batch_size: int, shard_params: bool = False):
    P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
    self.rep = jax.sharding.NamedSharding(mesh, P())
    # Sharded parameters: each device holds width / devices of them.
    self.params = (jax.sharding.NamedSharding(mesh, P('data')) if shard_params
                   else self.rep)
    self.row = jax.sharding.NamedSharding(mesh, P('data', None))
    self.label = jax.sharding.NamedSharding(mesh, P('data'))
    self.width, self.batch_size = width, batch_size
    # Identical synthetic fixture on every controller.
    self.data = np.random.default_rng(41).normal(
        size=(samples, width)).astype(np.float32)
    self.truth = np.linspace(-0.3, 0.4, width, dtype=np.float32)
    self.targets = self.data @ self.truth
    self.lr = learning_rate(width, batch_size)
    lr = self.lr

    params = {'weights': self.params, 'momentum': self.params}

    @functools.partial(jax.jit, out_shardings=(params, self.rep))
    def update(user, batch):
      x, y = batch
      w, velocity = user['weights'], user['momentum']
      loss, grad = jax.value_and_grad(lambda a: jnp.mean((x @ a - y)**2))(w)
      v = MOMENTUM * velocity + grad
      return {'weights': w - lr * v, 'momentum': v}, loss

    self.update = update

  def placed(self, value: np.ndarray, sharding) -> jax.Array:
    a = np.asarray(value)
    return jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])

  def initial_user_state(self) -> dict[str, jax.Array]:
    zeros = np.zeros(self.width, np.float32)
    return {'weights': self.placed(zeros, self.params),
            'momentum': self.placed(zeros, self.params)}

  def batch(self, ids: np.ndarray):
    return (self.placed(self.data[ids], self.row),
            self.placed(self.targets[ids], self.label))

  def check(self, old_user, new_user, ids, loss) -> None:
    """Checks one step against an independent host-side computation.

    The host recomputes the gradient in float64 from the same data. The
    tolerance is the tutorial's (rtol 2e-5, atol 2e-6) plus the rounding
    bound of the device's float32 sums, which grows with the width; at the
    tutorial's sizes that bound is negligible.
    """
    old, new = recovery.host_tree(old_user), recovery.host_tree(new_user)
    x = self.data[ids].astype(np.float64)
    y = self.targets[ids].astype(np.float64)
    w_old = old['weights'].astype(np.float64)
    residual = x @ w_old - y
    g = 2 * x.T @ residual / self.batch_size
    eps = float(np.finfo(np.float32).eps)
    scale = 2 / self.batch_size * np.abs(x).T @ (np.abs(x) @ np.abs(w_old)
                                                 + np.abs(y))
    rounding = 4 * eps * math.sqrt(self.width + self.batch_size) * scale
    _close('loss', np.float64(loss), np.mean(residual**2),
           4 * eps * np.mean((np.abs(x) @ np.abs(w_old) + np.abs(y))**2))
    _close('momentum', new['momentum'],
           MOMENTUM * old['momentum'].astype(np.float64) + g, rounding)
    _close('weights', new['weights'],
           w_old - self.lr * new['momentum'].astype(np.float64), 0.0)


def _close(name: str, actual, desired, slack) -> None:
  """Raises AssertionError unless |actual - desired| <= tolerance + slack."""
  actual = np.asarray(actual, np.float64)
  err = np.abs(actual - desired)
  tol = recovery.ATOL + recovery.RTOL * np.abs(desired) + slack
  if not np.all(err <= tol):
    i = np.unravel_index(np.argmax(err - tol), np.shape(err))
    raise AssertionError(
        f'{name} differs from the host check at index {tuple(map(int, i))}: '
        f'device {np.asarray(actual)[i]!r}, host {np.asarray(desired)[i]!r}, '
        f'tolerance {np.broadcast_to(tol, np.shape(err))[i]:.3g} (rtol='
        f'{recovery.RTOL}, atol={recovery.ATOL} plus float32 rounding).')


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


def _flag_advice(e: recovery.CheckpointError) -> str:
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


def main(argv):
  del argv  # Unused.
  if not F.ORBAX_INFO.value:
    recovery.quiet_orbax_logs()
  recovery.quiet_third_party_noise()
  if multihost.env.NUM_CPU_DEVICES not in os.environ:
    jax.config.update('jax_num_cpu_devices', F.NUM_CPU_DEVICES.value)
  multihost.initialize()
  rule = F.step_deadline_rule()
  if rule is not None:
    multihost.set_step_deadline(**rule)
  pid = jax.process_index()
  prefix = lowlevel.process_prefix()
  _check_same_flags(prefix)
  count = jax.device_count()
  batch_size = F.BATCH_SIZE.value
  if batch_size % count:
    raise UsageError(
        f'--batch_size={batch_size} must be a multiple of the device count '
        f'({count}), since the batch is sharded over all devices.')
  if batch_size > F.SAMPLES.value:
    raise UsageError(
        f'--batch_size={batch_size} exceeds --samples={F.SAMPLES.value}.')
  directory = F.CHECKPOINT_DIR.value
  if not directory:
    if jax.process_count() > 1:
      raise UsageError(
          'A multi-controller run needs --checkpoint_dir, a folder shared by '
          'every process.')
    if F.RESUME.value:
      raise UsageError('--resume needs --checkpoint_dir.')
    directory = tempfile.mkdtemp(prefix='multihost-train-')
  # Without --checkpoint_dir: removed when the run finishes, kept otherwise.
  temporary = None if F.CHECKPOINT_DIR.value else directory
  finished = False
  resume = _resume_mode()
  if pid == 0:
    print(f'Checkpoint folder: {directory}', flush=True)

  if F.LOCAL_SAVE_EVERY.value and not F.LOCAL_DIR.value:
    raise UsageError(
        f'--local_save_every={F.LOCAL_SAVE_EVERY.value} needs '
        '--local_checkpoint_dir (the host-local folder of the local tier).')
  if F.SHARD_PARAMS.value and F.WIDTH.value % count:
    raise UsageError(
        f'--shard_params needs --width={F.WIDTH.value} to be a multiple of the '
        f'device count ({count}).')
  mesh = jax.make_mesh((count,), ('data',))
  model = LinearRegression(mesh, width=F.WIDTH.value, samples=F.SAMPLES.value,
                           batch_size=batch_size,
                           shard_params=F.SHARD_PARAMS.value)
  first_attempt = os.environ.get(multihost.env.RESTART_COUNT, '0') in ('',
                                                                      '0')
  sampler = recovery.EpochSampler(F.SAMPLES.value, batch_size)
  upcoming = [0]  # The step whose batch data_fn loads next.

  def data_fn(ids):
    F.stall(upcoming[0], pid, first_attempt=first_attempt)
    return model.batch(ids)

  loop = recovery.ResilientLoop(model.update, data_fn=data_fn,
                                sampler=sampler, check_fn=model.check)
  initial = loop.init(model.initial_user_state(),
                      jax.random.key(F.SEED.value))

  metrics = None
  checked = [time.monotonic()]  # When the straggler check last ran.
  # Set when the run resumed: the first step after it is announced.
  announce_first_step = [False]

  def on_step(state, record):
    if announce_first_step[0]:
      announce_first_step[0] = False
      # Every process: when each one trains again (bench/restart_drill.py).
      print(f'{prefix} Training again: step {record.step} done at '
            f'{time.time():.3f}.', flush=True)
    every = F.STRAGGLER_EVERY.value
    if every and jax.process_count() > 1 and record.step % every == 0:
      report = multihost.straggler_report()  # Every process, same step.
      step_s, checked[0] = (time.monotonic() - checked[0]) / every, \
          time.monotonic()
      if pid == 0 and report.matters(step_seconds=step_s):
        logging.warning('%s step %d: %s', prefix, record.step,
                        report.summary())
    if F.METRICS_OUT.value:
      digest = recovery.checkpoint_digest(state)  # Every process: may be collective.
      if metrics is not None:
        metrics.write(json.dumps({'step': record.step, 'loss': record.loss,
                                  'ids': record.ids.tolist(),
                                  'digest': digest}) + '\n')
        if record.step % F.SAVE_EVERY.value == 0:  # A save began (bin/plot.py).
          metrics.write(json.dumps({'event': 'save', 'step': record.step}) +
                        '\n')
        metrics.flush()
    F.drill(record.step, pid, first_attempt=first_attempt,
            checkpoints=checkpoints)
    upcoming[0] = record.step + 1

  if pid == 0:  # The same on every process.
    logging.info('%s %d processes, %d devices, width=%d samples=%d batch=%d '
                 'lr=%g', prefix, jax.process_count(), count, F.WIDTH.value,
                 F.SAMPLES.value, batch_size, model.lr)
  # Until training starts, a CheckpointError means no usable checkpoint
  # where the run needs one: every attempt would fail the same way.
  started = False
  try:
    with recovery.Checkpoints(directory, save_every=F.SAVE_EVERY.value,
                              keep=F.KEEP.value,
                              async_save=F.ASYNC_SAVE.value,
                              local_directory=F.LOCAL_DIR.value or None,
                              local_save_every=(F.LOCAL_SAVE_EVERY.value or None
                                                if F.LOCAL_DIR.value else None)
                              ) as checkpoints:
      state = checkpoints.start(initial, resume=resume)
      resumed = checkpoints.resumed_from is not None
      upcoming[0] = state.step + 1
      if state.step > F.STEPS.value:
        raise recovery.CheckpointError(
            f'{prefix} The latest checkpoint in {directory} is at step '
            f'{state.step}, beyond --steps={F.STEPS.value}. Pass a larger '
            '--steps to continue training.')
      started = True
      if F.METRICS_OUT.value and pid == 0:
        try:
          # A resumed run continues the file; a fresh run starts it anew.
          metrics = open(F.METRICS_OUT.value, 'a' if resumed else 'w')
        except OSError as e:
          raise UsageError(
              f'--metrics_out={F.METRICS_OUT.value} cannot be opened for '
              f'writing: {e}') from e
      if metrics is not None and resumed:  # bin/plot.py marks it.
        restarted = int(os.environ.get(multihost.env.RESTART_COUNT) or 0) > 0
        metrics.write(json.dumps({'event': 'restart' if restarted else 'resume',
                                  'step': state.step, 'tier':
                                  checkpoints.resumed_tier}) + '\n')
      if metrics is not None:  # Each damaged folder renamed, either tier.
        for aside in checkpoints.set_aside:  # (bin/plot.py marks them.)
          metrics.write(json.dumps({'event': 'set_aside', 'step': aside.step,
                                    'tier': aside.tier,
                                    'moved_to': aside.path,
                                    'resumed_from': state.step}) + '\n')
      if resumed:
        announce_first_step[0] = True
        tier = checkpoints.resumed_tier
        peers = (checkpoints.local.restored_bytes_from_peers
                 if tier == 'local' else 0)
        # Every process: the bytes each fetched from its peers differ.
        print(f'{prefix} Resumed from step {state.step} (epoch {state.epoch}) '
              f'from the {tier} tier, {peers} bytes from peers, at '
              f'{time.time():.3f}.', flush=True)
      result = loop.run(state, until_step=F.STEPS.value,
                        checkpoints=checkpoints, on_step=on_step,
                        handle_sigterm=F.HANDLE_SIGTERM.value,
                        progress_every_s=F.PROGRESS_EVERY.value)
      state = result.state
      digest = recovery.checkpoint_digest(state)
      last_loss = result.last_loss
      if result.preempted:
        if pid == 0:
          again = ('--resume' if temporary is None else
                   f'--checkpoint_dir={directory} --resume')
          print(f'Preempted: saved step {state.step} to {directory}; exiting '
                f'0. Relaunch with {again} to continue.', flush=True)
        return
      if pid == 0:
        trained = ('nothing left to train' if last_loss is None
                   else f'last loss {last_loss}')
        print(f'Finished step {state.step} (epoch {state.epoch}) '
              f'digest {digest} checkpoints {checkpoints.steps()} '
              f'{trained}', flush=True)
      if F.VERIFY_REPLAY.value:
        restored = checkpoints.restore(initial, step=state.step)
        replay = recovery.verify_replay(loop, state, restored,
                                        F.VERIFY_REPLAY.value)
        if pid == 0:
          print(f'Replay check passed: {len(replay)} steps from checkpoint '
                f'step {state.step}: sample ids identical, losses and state '
                f'within rtol={recovery.RTOL}, atol={recovery.ATOL}.')
          print('Replay ids: ' + json.dumps([r.ids.tolist() for r in replay]))
          print('Replay losses: ' + json.dumps(
              [[r.reference_loss, r.replayed_loss] for r in replay]),
              flush=True)
    finished = True
  except recovery.CheckpointError as e:
    _fail(f'{prefix} {type(e).__name__}: {e}{_flag_advice(e)}',
          code=2 if started else NO_RETRY)
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
    if metrics is not None:
      metrics.close()
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
