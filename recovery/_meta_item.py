"""The checkpoint's JSON `meta` item, whose content may arrive after its save starts.

A save writes the state item in Orbax's background while the controllers
digest the state and agree that they hold the same one. The meta item (which
carries those digests) is handed to Orbax as a `Pending` content: its write,
and so the checkpoint's commit, waits until `give()` is called, and fails
(so nothing commits) after `abandon()`. Restoring reads the same JSON file that
`ocp.JsonCheckpointHandler` writes, so checkpoints of either kind read alike.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from typing import Any

from absl import logging
import jax
import orbax.checkpoint as ocp

FILENAME = 'metadata'  # JsonCheckpointHandler's default file name

# A backstop only: the saving thread resolves the content on every path
# (`Checkpoints.save` gives or abandons it in a try block), and its own
# waits all have timeouts. Orbax bounds the background commit as well.
_WAIT_SECONDS = 3600.0


class AbandonedError(RuntimeError):
  """The meta item's content was abandoned: the save must not commit."""


def _reports_abandoned_save(record) -> bool:
  """Whether a log record is Orbax reporting a save that we abandoned."""
  error = record.exc_info[1] if record.exc_info else None
  for _ in range(16):  # a chain of causes, bounded
    if error is None:
      break
    if isinstance(error, AbandonedError):
      return True
    error = error.__cause__ or error.__context__
  try:
    return AbandonedError.__name__ in record.getMessage()
  except Exception:  # pylint: disable=broad-except
    return False  # a malformed record is not ours to drop


@functools.cache
def _quiet_abandoned_saves() -> None:
  """Drops Orbax's error reports (three tracebacks) of a save we abandoned.

  Installed once. The caller of `Checkpoints.save` gets the reason itself,
  as an exception.
  """
  logging.get_absl_logger().addFilter(
      lambda record: not _reports_abandoned_save(record))


class Pending:
  """The content of a meta item whose save has started: given once, or abandoned."""

  def __init__(self, what: str):
    self._what = what
    self._done = threading.Event()
    self._content: dict[str, Any] | None = None
    self._why: BaseException | None = None

  def give(self, content: dict[str, Any]) -> None:
    self._content = content
    self._done.set()

  def abandon(self, why: BaseException) -> None:
    self._why = why
    self._done.set()

  def result(self) -> dict[str, Any]:
    if not self._done.wait(_WAIT_SECONDS):
      raise TimeoutError(
          f'{self._what}: the metadata item was not given within '
          f'{_WAIT_SECONDS:.0f} s of the save starting; not committing.')
    if self._why is not None:
      raise AbandonedError(
          f'{AbandonedError.__name__}: {self._what}: not committed '
          f'({type(self._why).__name__}: {self._why})')
    return self._content


class Handler(ocp.JsonCheckpointHandler):
  """`JsonCheckpointHandler` that also saves a `Pending` content (`DeferredSave`)."""

  def __init__(self, *, multiprocessing_options: ocp.options.MultiprocessingOptions):
    super().__init__(FILENAME, multiprocessing_options=multiprocessing_options)
    self._writer = multiprocessing_options.primary_host
    _quiet_abandoned_saves()

  async def async_save(self, directory, item=None, args=None):
    if not isinstance(args, DeferredSave):
      return await super().async_save(directory, item, args)
    return [ocp.future.CommitFutureAwaitingContractedSignals(
        self._write_when_given(directory, args.content),
        name='recovery_meta_save')]

  async def _write_when_given(self, directory, content: Pending) -> None:
    value = content.result()  # on Orbax's commit thread, not the caller's
    if self._writer is None or self._writer == jax.process_index():
      (directory / FILENAME).write_text(json.dumps(value))


@ocp.args.register_with_handler(Handler, for_save=True)
@dataclasses.dataclass
class DeferredSave(ocp.args.CheckpointArgs):
  content: Pending


@ocp.args.register_with_handler(Handler, for_restore=True)
@dataclasses.dataclass
class Restore(ocp.args.CheckpointArgs):
  pass
