"""Orbax's `CheckpointManager` as recovery uses it: options, items, watched calls, logs."""

from __future__ import annotations

from collections.abc import Callable
import functools
import os
from typing import Any

from absl import logging
from absl.logging import converter
import jax
import orbax.checkpoint as ocp

import multihost
from multihost import process_prefix as _prefix
from recovery._src.checkpoint import folder
from recovery._src.state.errors import CheckpointError
from recovery._src.state.errors import shorten as _short

STATE_ITEM = 'state'
META_ITEM = 'meta'
# How long Orbax's barriers wait for every process (its default, seconds):
# a restore ends at one, which a process whose read failed never reaches.
ORBAX_BARRIER_TIMEOUT_S = 300


def manager(directory: str, *, async_save: bool,
            read_only: bool) -> ocp.CheckpointManager:
  """A `CheckpointManager` on `directory` with a `state` and a `meta` item.

  Keep-N, the save schedule and creating the folder are the caller's; Orbax
  only saves, restores and deletes the steps it is told to.

  Raises:
    CheckpointError: Orbax cannot open the folder.
  """
  # Naming every process as active makes Orbax meet at the coordination
  # service's barriers (with a timeout) instead of at JAX's
  # sync_global_devices, a device all-gather per barrier (a save meets 8
  # times). Orbax then leaves creating the folder to the caller.
  processes = jax.process_count()
  multiprocessing = _multiprocessing()
  options = ocp.CheckpointManagerOptions(
      max_to_keep=None,  # keep-N deletes only this run's own steps
      # Saves are scheduled by the caller; Orbax's own interval is unused.
      save_interval_steps=0 if read_only else 1,
      enable_async_checkpointing=async_save,
      create=not read_only and processes == 1,
      read_only=read_only,
      cleanup_tmp_directories=False,
      multiprocessing_options=multiprocessing,
  )
  try:
    return ocp.CheckpointManager(
        directory, options=options,
        item_handlers={
            STATE_ITEM: ocp.StandardCheckpointHandler(
                multiprocessing_options=multiprocessing),
            META_ITEM: ocp.JsonCheckpointHandler(
                multiprocessing_options=multiprocessing)})
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(
        f'{_prefix()} Cannot open checkpoint folder {directory}: '
        f'{type(e).__name__}: {e}') from e


def _multiprocessing() -> ocp.options.MultiprocessingOptions:
  processes = jax.process_count()
  return ocp.options.MultiprocessingOptions(
      active_processes=set(range(processes)) if processes > 1 else None)


def reader() -> ocp.Checkpointer:
  """An Orbax `Checkpointer` of this process alone that restores a step's `state` item as a PyTree, some leaves skipped (`read_once`).

  The manager's `StandardCheckpointHandler` restores every leaf. This one
  meets no other process (its only active process is this one): where one
  process's read fails, the others do not wait at an Orbax barrier for
  it; the caller's agreement after the read is where they meet.
  """
  me = jax.process_index()
  multiprocessing = ocp.options.MultiprocessingOptions(
      primary_host=me, active_processes={me})
  return ocp.Checkpointer(
      ocp.PyTreeCheckpointHandler(multiprocessing_options=multiprocessing),
      multiprocessing_options=multiprocessing)


def save_args(tree: Any, meta: dict[str, Any]) -> ocp.args.Composite:
  return ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(tree),
                               META_ITEM: ocp.args.JsonSave(meta)})


def restore_args(abstract: Any) -> ocp.args.Composite:
  return ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract)})


def _delete_failed(step: int, directory: str, e: Exception) -> str:
  """What a failed delete of an old checkpoint step says."""
  return (f'{_prefix()} Deleting old checkpoint step {step} in {directory} '
          f'failed: {type(e).__name__}: {_short(e)}. Newer steps are '
          'untouched; remove it by hand if it remains.')


def watched(op: str, fn: Callable[[], Any],
            explain: Callable[[Exception], str]) -> Any:
  """Runs an Orbax call that every process takes part in.

  Under the failure watchdog (`multihost.call_watched`), since Orbax's
  barriers would wait for a dead peer indefinitely: a dead peer raises
  `ProcessFailureError`; any other failure becomes a `CheckpointError` whose
  message is `explain(error)`.
  """
  try:
    return multihost.call_watched(fn, op=op)
  except multihost.ProcessFailureError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(explain(e)) from e


def quiet_orbax_logs() -> None:
  """Drops Orbax's INFO log lines (many per save) from absl's log handler.

  For binaries; warnings and errors from Orbax still show.
  """
  logging.get_absl_handler().addFilter(_not_orbax_info)


def _not_orbax_info(record) -> bool:
  return record.levelno >= converter.STANDARD_WARNING or (
      f'{os.sep}orbax{os.sep}' not in record.pathname)


def prune(mgr: ocp.CheckpointManager, directory: str, committed: list[int],
          *, keep: int) -> None:
  """Keeps the newest `keep` of `committed` (in place); deletes real folders only.

  Every process holds the same `committed`, so all delete the same steps,
  or all skip the (collective) delete together. Right before each delete,
  every process checks that the step is still a real folder directly
  inside the real checkpoint folder; one that became a symlink (or moved
  out) is dropped from keep-N, untouched. Processes that disagreed on
  that check would fail Orbax's delete barrier with a CheckpointError, so
  a disagreement deletes nothing anywhere but process 0's checked step.
  """
  for step in committed[:-keep]:
    committed.remove(step)
    path = os.path.join(directory, str(step))
    if not folder.inside(directory, str(step)):
      logging.warning(
          '%s Not deleting old checkpoint step %d: %s is now a symlink or '
          'lies outside the folder (real path %s); left untouched.',
          _prefix(), step, path, os.path.realpath(path))
      continue
    # Orbax's delete meets the other processes: watched.
    watched(
        f'delete checkpoint step {step}', functools.partial(mgr.delete, step),
        functools.partial(_delete_failed, step, directory))
