"""Quiet binaries: the third-party lines that tell a user nothing to do.

Each filter drops one known line, by its source and text, and lets
everything else through, so a real warning or error still shows. With
absl's `--verbosity=1` (debug) nothing is dropped; `TF_CPP_MIN_LOG_LEVEL=0`
keeps JAX's C++ warnings too.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading

from absl import logging
from absl.logging import converter

from multihost import env as _env
from multihost import lowlevel

# JAX's variable for its C++ log threshold (0 all, 1 warnings, 2 errors).
CPP_LOG_LEVEL = _env.CPP_LOG_LEVEL
_ORBAX = f'{os.sep}orbax{os.sep}'
# (where the record comes from, how its format string starts): lines with no
# action for the user.
_DROPPED = (
    # read_only=True is what the caller asked for.
    (_ORBAX, 'Given directory is read only'),
    # Logged by each Orbax call that sees the sync point (a save and its
    # finalize thread); the loop logs the stop once per process.
    (_ORBAX, '[process=%s][thread=%s] Reached preemption sync point'),
)
# JAX's INFO lines at `jax.distributed.initialize`, every process's: multihost
# says the same in one line ("jax.distributed initialized: N processes").
_JAX_DISTRIBUTED = (f'{os.sep}jax{os.sep}_src{os.sep}distributed.py',
                    ('JAX distributed initialized with visible devices',
                     'Connecting to JAX distributed service'))
# INFO lines every process logs alike, after its `[process=N] ` prefix:
# process 0's tells them for all.
_SAID_BY_ALL = ('multihost failure watchdog started',
                'jax.distributed initialized:', 'Resuming from local step',
                'Resuming from checkpoint step', 'Restored local step')
# The same of warnings: a fact of the shared checkpoint folder.
_WARNED_BY_ALL = ('holds uncommitted (partial) saves',)
_OTHER_PROCESS = re.compile(r'^\[process=([1-9]\d*)\] ')
# asyncio's "<Task, Future or a subclass> exception was never retrieved".
_NEVER_RETRIEVED = re.compile(
    r'\w*(Task|Future) exception was never retrieved')
# Set once the filters and hook are in (process-wide hooks, installed once).
_INSTALLED = threading.Event()


def verbose() -> bool:
  """True when absl's --verbosity asks for debug lines: nothing is dropped."""
  return logging.get_verbosity() >= logging.DEBUG


def _keep(record) -> bool:
  """The absl handler's filter: False for a line of `_DROPPED` and kin."""
  if verbose():
    return True
  msg = str(record.msg)
  for where, start in _DROPPED:
    if where in record.pathname and msg.startswith(start):
      return False
  info = record.levelno < converter.STANDARD_WARNING
  # JAX says at INFO that it found no TPU on a machine that has none.
  if info and msg.startswith('Unable to initialize backend'):
    return False
  if info and (_JAX_DISTRIBUTED[0] in record.pathname and
               msg.startswith(_JAX_DISTRIBUTED[1])):
    return False
  if record.levelno < converter.STANDARD_ERROR and msg.startswith(
      '%s '):
    try:
      text = record.getMessage()
    except (TypeError, ValueError):
      return True
    other = _OTHER_PROCESS.match(text)
    said = _SAID_BY_ALL if info else ()
    if other and (text[other.end():].startswith(said) or
                  _WARNED_BY_ALL[0] in text):
      return False
  # After one read of a damaged checkpoint failed, Orbax stops waiting for
  # the others; their TensorStore errors (the same damage, already reported
  # as a CheckpointError) are then logged as never retrieved, one per leaf
  # (as a Task's, a bare Future's or asyncio.gather's _GatheringFuture's,
  # depending on which awaited it: asyncio names the class).
  if record.name == 'asyncio' and _NEVER_RETRIEVED.match(msg):
    error = record.exc_info[1] if record.exc_info else None
    if error is not None and 'tensorstore_spec' in str(error):
      return False
  return True


def _is_closed_loop_callback(unraisable) -> bool:
  """TensorStore's callback into an event loop Orbax has already closed.

  TensorStore completes a read that Orbax no longer awaits and calls the
  loop's `call_soon_threadsafe` from its own thread: no Python frame of
  ours or of Orbax is on that stack, only asyncio's.
  """
  if not (unraisable.exc_type is RuntimeError and
          str(unraisable.exc_value) == 'Event loop is closed'):
    return False
  tb = unraisable.exc_traceback
  if tb is None:
    return False
  while tb is not None:
    if f'{os.sep}asyncio{os.sep}' not in tb.tb_frame.f_code.co_filename:
      return False
    tb = tb.tb_next
  return True


def quiet_third_party_noise() -> None:
  """Drops the JAX, Orbax, asyncio and TensorStore lines that need no action.

  For binaries (it changes process-wide hooks); calling it again does
  nothing more. Dropped: Orbax's "Given directory is read only" and its
  "Reached preemption sync point" (the loop logs the stop), JAX's INFO that
  a TPU backend is absent, and after a failed read of a damaged checkpoint
  (reported as a `CheckpointError`) asyncio's "Task (or Future, or
  _GatheringFuture) exception was never retrieved" and TensorStore's
  "RuntimeError: Event loop is closed" for the reads still in flight;
  JAX's INFO lines as it connects a process ("visible devices",
  "Connecting to"), and on processes other than 0 the
  INFO lines every process logs alike (the failure watchdog and
  jax.distributed started, resuming from and restored a step) and the
  warning that the checkpoint folder holds partial saves: process 0's
  tell them. Any other line shows as before; with absl's
  `--verbosity=1` every line shows.
  """
  if _INSTALLED.is_set():
    return
  _INSTALLED.set()
  logging.get_absl_handler().addFilter(_keep)
  previous = sys.unraisablehook

  def hook(unraisable):
    if verbose() or not _is_closed_loop_callback(unraisable):
      previous(unraisable)

  sys.unraisablehook = hook


@contextlib.contextmanager
def cpp_warnings_hidden():
  """JAX's C++ logs show errors only, inside the block (warnings hidden).

  With recoverability on, starting the coordination service logs the C++
  advice "... should invoke `WaitAtBarrier` explicitly at the end of the
  program", which `multihost` does for you at exit; `multihost.initialize()`
  hides it by itself, and this block does the same around other code. Errors
  still show. Outside the block the threshold
  is $TF_CPP_MIN_LOG_LEVEL again (JAX's default, 1: warnings and errors).
  With TF_CPP_MIN_LOG_LEVEL=0 or absl's --verbosity=1 nothing is hidden.
  """
  if verbose():
    yield
    return
  with lowlevel.cpp_warnings_hidden():
    yield
