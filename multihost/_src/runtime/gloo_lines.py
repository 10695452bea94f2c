"""Runtime: this process's stdout (file descriptor 1) without gloo's connection lines; everything else passes, unchanged and at once.

JAX's CPU collectives (gloo, inside jaxlib) print one line per local device
from C++ (`std::cout`) each time they connect a new set of devices: at the
first collective of each communicator, so at any step, not only at
`initialize()`:

    [Gloo] Rank 3 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3

No JAX setting or environment variable silences it (jaxlib 0.10.2). Several
threads print at once, one `<<` piece at a time, so pieces of two lines
interleave (`[Gloo] Rank [Gloo] Rank 1 is connected to ...`, then `0 is
connected to ...`). `install()` points file descriptor 1 at a pipe (a pty, where
stdout is a terminal, as under Open MPI) that a daemon thread reads: it drops the lines made only of those pieces and
numbers (see `LineFilter`) and writes everything else to the original
stdout as it comes: a partial line without a newline (a prompt)
at once, unless it could still become such a line, then after at most
HOLD_S. Bytes are passed as they are (no decoding); memory does not grow
with the output. stderr is left alone.

At exit (atexit, and `drain()` before an `os._exit`), what is in the pipe
is written out. A SIGKILL loses what the thread had not read yet (a pipe's
worth at most, usually nothing). Child processes inherit the pipe as their
stdout: what they print is filtered too while this process lives; a forked
child (without exec) gets the original stdout back. Should filtering fail,
the pipe is copied through unfiltered; should copying fail too, the
original stdout is put back.
"""

from __future__ import annotations

import array
import atexit
import errno
import fcntl
import os
import re
import select
import sys
import termios
import threading
import time
import tty

# The pieces gloo's line is printed in (each one `<<`), numbers aside.
PIECES = (b'[Gloo] Rank ', b' is connected to ', b' peer ranks. ',
          b'Expected number of connected peer ranks is : ')
_WORDS = re.compile(b'(?:' + b'|'.join(re.escape(p) for p in PIECES) +
                    rb'|\d)*')
# How long a partial line that could still become gloo's is held back.
HOLD_S = 0.05
# How long a gloo line may stay open (its newline not come yet).
OPEN_S = 1.0
# The longest partial line held back (longer: passed as it is).
MAX_HELD = 4096
_READ = 1 << 16


def could_be_gloo(start: bytes) -> bool:
  """Whether a line that starts with `start` could still be one of gloo's."""
  rest = start[_WORDS.match(start).end():]
  return any(p.startswith(rest) for p in PIECES)


class LineFilter:
  """Drops gloo's lines from a byte stream fed in chunks; memory bounded by MAX_HELD.

  A line is gloo's when it is made only of gloo's pieces and numbers and
  some gloo line is still open: one whose first piece came and whose
  newline has not. Each line's newline closes one. So a line of the
  exact form starts and ends one; the pieces of interleaved lines
  (`[Gloo] Rank [Gloo] Rank 1 ...`, then `0 is connected to ...`), and
  even an empty or numbers-only line they leave, go while one is open;
  the same words or numbers alone elsewhere stay.
  """

  def __init__(self) -> None:
    self.held = b''        # The current line so far, while it could be gloo's.
    self.passing = False   # The current line is not gloo's: pass the rest.
    self.open = 0          # gloo lines started whose newline has not come.
    self.open_until = 0.0  # Lines left open longer are forgotten.

  def _is_gloo(self, line: bytes) -> bool:
    if _WORDS.fullmatch(line) is None:
      return False
    now = time.monotonic()
    owed = self.open if now < self.open_until else 0
    started = line.count(PIECES[0])
    if owed + started == 0:
      return False
    self.open, self.open_until = owed + started - 1, now + OPEN_S
    return True

  def feed(self, data: bytes) -> bytes:
    """The bytes to write now for `data`."""
    out, start = [], 0
    while start < len(data):
      end = data.find(b'\n', start)
      part = data[start:] if end < 0 else data[start:end + 1]
      start += len(part)
      if self.passing:
        out.append(part)
      else:
        line = self.held + part
        self.held = b''
        if end >= 0:
          if not self._is_gloo(line[:-1]):
            out.append(line)
        elif len(line) <= MAX_HELD and could_be_gloo(line):
          self.held = line
        else:
          out.append(line)
          self.passing = True
      if end >= 0:
        self.passing = False
    return b''.join(out)

  def release(self) -> bytes:
    """The partial line held back, to write as it is (nothing more came)."""
    held, self.held = self.held, b''
    if held:
      self.passing = True
    return held


def _channel(original: int) -> tuple[int, int]:
  """(read end, write end): a pipe; a pty where `original` is a terminal.

  Open MPI gives each rank a pty as its stdout, and a program on a terminal
  asks `isatty`: a pty keeps their answer (and the C library's line
  buffering). Raw, so that it passes bytes unchanged (no newline to
  CR-LF), with the terminal's size.
  """
  if not os.isatty(original):
    return os.pipe()
  read_end, write_end = os.openpty()
  tty.setraw(write_end)
  try:
    size = fcntl.ioctl(original, termios.TIOCGWINSZ, b'\0' * 8)
    fcntl.ioctl(write_end, termios.TIOCSWINSZ, size)
  except OSError:
    pass
  return read_end, write_end


def _identity(fd: int) -> tuple[int, int]:
  """What `fd` is open on (device, inode)."""
  info = os.fstat(fd)
  return info.st_dev, info.st_ino


def _write_all(fd: int, data: bytes) -> bool:
  """Writes `data` to `fd`; False when `fd` no longer takes it."""
  view = memoryview(data)
  while view:
    try:
      view = view[os.write(fd, view):]
    except InterruptedError:
      continue
    except OSError:
      return False
  return True


class StdoutFilter:
  """File descriptor `fd` through a pipe and a reader thread that drops gloo's lines."""

  def __init__(self, fd: int = 1) -> None:
    self.fd = fd
    self.pid = os.getpid()
    self.original = os.dup(fd)  # os.dup and os.pipe: not inherited on exec.
    self.read_end, write_end = _channel(self.original)
    self.wake_r, self.wake_w = os.pipe()
    self.closing = False
    self.busy = False
    self.lines = LineFilter()
    self.channel = _identity(write_end)
    os.dup2(write_end, fd)
    os.close(write_end)
    self.thread = threading.Thread(target=self._run, daemon=True,
                                   name='multihost-stdout-filter')
    self.thread.start()

  def _run(self) -> None:
    try:
      self._copy(self.lines.feed)
    except BaseException:  # noqa: BLE001  A bug here must not block writers.
      try:
        self.lines, self.busy = LineFilter(), False
        self._copy(lambda data: data)  # Unfiltered, in order.
      finally:
        if not self.closing:  # Even copying failed: no pipe any more.
          self._put_back()

  def _copy(self, transform) -> None:
    """Copies the pipe to the original stdout through `transform` until EOF, or until the pipe is empty once closing."""
    ok = True  # False once the original stdout is gone (EPIPE): keep
    # reading then, so that writers never block on a full pipe.
    poller = select.poll()
    poller.register(self.read_end, select.POLLIN)
    poller.register(self.wake_r, select.POLLIN)
    while True:
      wait = HOLD_S * 1000 if self.lines.held or self.closing else None
      ready = [fd for fd, _ in poller.poll(wait)]
      if self.read_end not in ready:
        ok = ok and _write_all(self.original, self.lines.release())
        if self.closing:
          return
        continue
      self.busy = True
      try:
        data = os.read(self.read_end, _READ)
      except OSError as e:  # A pty's last writer gone: EIO, not EOF.
        if e.errno != errno.EIO:
          raise
        data = b''
      if not data:
        _write_all(self.original, self.lines.release())
        return
      try:
        out = transform(data)
      except BaseException:
        _write_all(self.original, self.lines.held + data)  # Nothing lost.
        raise
      ok = ok and _write_all(self.original, out)
      self.busy = False

  def pending(self) -> bool:
    """Whether bytes written to `fd` are not out yet."""
    waiting = array.array('i', [0])
    fcntl.ioctl(self.read_end, termios.FIONREAD, waiting)
    return bool(waiting[0] or self.busy or self.lines.held)

  def drain(self, timeout: float = 1.0) -> None:
    """Waits (up to `timeout` s) until what was written to `fd` so far is out."""
    if os.getpid() != self.pid:
      return
    deadline = time.monotonic() + timeout
    while (self.thread.is_alive() and self.pending() and
           time.monotonic() < deadline):
      time.sleep(0.001)

  def close(self, timeout: float = 2.0) -> None:
    """Puts the original stdout back after writing out what the pipe holds (up to `timeout` s).

    The pipe may outlive this: children that inherited it keep it open.
    """
    if os.getpid() != self.pid or self.closing:
      return
    try:
      sys.stdout.flush()
    except (OSError, ValueError):
      pass
    self.closing = True
    self._put_back()  # This process's write end closes here.
    os.write(self.wake_w, b'x')
    self.thread.join(timeout)
    if not self.thread.is_alive():
      for fd in (self.original, self.read_end, self.wake_r, self.wake_w):
        os.close(fd)

  def _put_back(self) -> None:
    """The original stdout at `fd` again, unless something else (pytest's capture) has replaced the pipe there since."""
    try:
      if _identity(self.fd) == self.channel:
        os.dup2(self.original, self.fd)
    except OSError:
      pass

  def forked(self) -> None:
    """In a forked child: the original stdout back, the pipes closed (no reader runs here)."""
    self.closing = True
    self._put_back()
    for fd in (self.original, self.read_end, self.wake_r, self.wake_w):
      os.close(fd)


# The filter of this process's stdout, once installed (one at most).
_INSTALLED: list[StdoutFilter] = []


def install() -> bool:
  """Filters gloo's lines out of this process's stdout from now on; returns whether it does (not where stdout is closed).

  Idempotent.
  """
  if _INSTALLED:
    return True
  try:
    os.fstat(1)
  except OSError:
    return False
  try:
    sys.stdout.flush()
  except (OSError, ValueError, AttributeError):
    pass
  stdout = StdoutFilter(1)
  _INSTALLED.append(stdout)
  atexit.register(stdout.close)
  os.register_at_fork(after_in_child=stdout.forked)
  return True


def drain(timeout: float = 1.0) -> None:
  """Before an `os._exit`: waits (up to `timeout` s) until the filter has written out what stdout was given."""
  for stdout in _INSTALLED:
    stdout.drain(timeout)
