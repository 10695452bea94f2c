"""Data plane: the TCP transport's worker threads (a plane's send thread, its lanes and copier) and a call's senders on them.

A plane starts its threads once and hands them each call's work (`Lane.run`,
`SendThread.sender`), so no call starts a thread. A call whose messages fit
in any socket buffer sends on its own thread instead (`DirectSender`).
Every wait here is bounded by the call's deadline.
"""

from __future__ import annotations

import os
import queue
import threading
import time

from multihost._src.runtime.deadline import Deadline
from multihost._src.transport.tcp import sockets


def cores() -> int:
  """The cores this process may run on."""
  try:
    return len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    return os.cpu_count() or 1


class SendThread:
  """One thread that sends queued jobs in order, for every call of a plane (not one thread per call)."""

  def __init__(self):
    self.jobs: queue.SimpleQueue = queue.SimpleQueue()
    self.lock = threading.Lock()
    self.thread: threading.Thread | None = None

  def sender(self, deadline: Deadline) -> Sender:
    """A call's sender on this thread (started on first use)."""
    with self.lock:
      if self.thread is None or not self.thread.is_alive():
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name='multihost-transport-send')
        self.thread.start()
    return Sender(self.jobs, deadline)

  def _run(self) -> None:
    while True:
      call, conn, view = self.jobs.get()
      if call is None:
        return
      if conn is None:  # The call's end marker: everything before it is out.
        view.set()
      elif call.error is None:
        try:
          sockets.send_all(conn, view, call.deadline)
        except BaseException as e:  # noqa: BLE001
          call.error = e

  def stop(self) -> None:
    self.jobs.put((None, None, None))


class Lane:
  """One thread that runs a plane's transfers on one extra lane, a job at a time (not a thread per call)."""

  def __init__(self, name: str):
    self.name = name
    self.jobs: queue.SimpleQueue = queue.SimpleQueue()
    self.thread: threading.Thread | None = None

  def run(self, fn) -> Job:
    """Runs `fn()` on this lane's thread (started on first use)."""
    if self.thread is None or not self.thread.is_alive():
      self.thread = threading.Thread(target=self._run, daemon=True,
                                     name=self.name)
      self.thread.start()
    job = Job()
    self.jobs.put((fn, job))
    return job

  def _run(self) -> None:
    while True:
      fn, job = self.jobs.get()
      if fn is None:
        return
      try:
        fn()
      except BaseException as e:  # noqa: BLE001  Handed to the caller.
        job.error = e
      job.done.set()
      # Not held while waiting for the next job: a job's arguments (a
      # result being copied, say) go back to the pool once their caller
      # lets go.
      fn = job = None

  def stop(self) -> None:
    self.jobs.put((None, None))


def _waited(done: threading.Event, deadline: float,
            what: str) -> TimeoutError | None:
  """None once `done` is set; a TimeoutError naming `what` if `deadline` passes first."""
  if not done.wait(max(deadline - time.monotonic(), 0.001)):
    return TimeoutError(f'{what} did not finish in time')
  return None


def _raise(error: BaseException | None) -> None:
  if error is not None:
    raise error


class Job:
  """A job on a `Lane`: set when it ended, with what it raised."""

  def __init__(self):
    self.done = threading.Event()
    self.error: BaseException | None = None

  def wait(self, deadline: float) -> BaseException | None:
    """What the job raised (None when it returned), or TimeoutError at `deadline`."""
    return _waited(self.done, deadline, 'a lane of the transfer') or self.error

  def join(self, deadline: float) -> None:
    """Waits for the job; raises what it raised, or TimeoutError at `deadline`."""
    _raise(self.wait(deadline))


class Sender:
  """One call's sends, queued on a `SendThread` and sent in order."""

  def __init__(self, jobs: queue.SimpleQueue, deadline: Deadline):
    self.jobs = jobs
    self.deadline = deadline
    self.error: BaseException | None = None

  def send(self, conn, view) -> None:
    self.jobs.put((self, conn, view))

  def finish(self, deadline: float) -> BaseException | None:
    """Waits until this call's sends are out; returns what sending raised."""
    done = threading.Event()
    self.jobs.put((self, None, done))
    return _waited(done, deadline, 'sending') or self.error

  def close(self, deadline: float) -> None:
    """Waits for the queued sends; raises what sending raised."""
    _raise(self.finish(deadline))


class DirectSender:
  """`Sender`'s interface, sending on the calling thread.

  For messages that fit in any socket buffer (`DIRECT_BYTES`): a send then
  never waits for the peer to read, so a ring of processes that all send
  before they receive cannot deadlock.
  """

  def __init__(self, deadline: Deadline):
    self.deadline = deadline
    self.error: BaseException | None = None

  def send(self, conn, view) -> None:
    sockets.send_all(conn, view, self.deadline)

  def finish(self, deadline: float) -> BaseException | None:
    del deadline
    return None

  def close(self, deadline: float) -> None:
    del deadline


# At most this many payload bytes per message are sent on the calling thread:
# with the frame header they fit in the smallest default socket buffers
# (tcp_wmem/tcp_rmem start at 16 KiB and 128 KiB), which `sockets.tune` leaves to
# the kernel.
DIRECT_BYTES = 8 << 10


def sender(deadline: Deadline, largest: int,
           thread: SendThread) -> Sender | DirectSender:
  """The sender of a call whose largest message is `largest` bytes."""
  return (DirectSender(deadline) if largest <= DIRECT_BYTES
          else thread.sender(deadline))
