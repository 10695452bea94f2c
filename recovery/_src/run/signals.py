"""The loop's signal handlers: SIGTERM as a flag, Ctrl-C as a preemption."""

from __future__ import annotations

import os
import signal
import threading

from absl import logging

from multihost import process_prefix as _prefix


class SigtermFlag:
  """A SIGTERM handler that only records the signal (main thread only).

  `received` turns True once it came (Python runs signal handlers on the
  main thread, between bytecodes: a loop reads it without a call).
  """

  def __init__(self):
    self.received = False
    self._previous = None

  def install(self) -> None:
    if threading.current_thread() is not threading.main_thread():
      logging.warning('%s Not on the main thread: SIGTERM keeps its current '
                      'handler.', _prefix())
      return
    self._previous = signal.signal(signal.SIGTERM, self._handle)

  def uninstall(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None

  def _handle(self, signum, frame) -> None:
    del signum, frame
    self.received = True

  def is_set(self) -> bool:
    return self.received


class SigintAsPreemption:
  """With several controllers: the first Ctrl-C becomes a preemption notice.

  JAX's preemption service listens for SIGTERM; the handler sends one to
  this process, so the controllers agree on a step, save it and stop, as on
  a real preemption. It then restores the previous SIGINT handler, so a
  second Ctrl-C raises KeyboardInterrupt as usual.
  """

  def __init__(self):
    self._previous = None

  def install(self) -> None:
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGINT, self._handle)

  def uninstall(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGINT, self._previous)
      self._previous = None

  def _handle(self, signum, frame) -> None:
    del signum, frame
    self.uninstall()
    logging.warning('%s Ctrl-C: stopping every controller at an agreed step '
                    'and saving it (as on a preemption). Press Ctrl-C again '
                    'to abort at once.', _prefix())
    os.kill(os.getpid(), signal.SIGTERM)
