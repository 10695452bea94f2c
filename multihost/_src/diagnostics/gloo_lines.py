"""Diagnostics: this process's stdout (file descriptor 1) without gloo's connection lines; everything else passes, unchanged and at once.

JAX's CPU collectives (gloo, inside jaxlib) print one line per local device
from C++ (`std::cout`) each time they connect a new set of devices: at the
first collective of each communicator, so at any step, not only at
`initialize()`:

    [Gloo] Rank 3 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3

No JAX setting or environment variable silences it (jaxlib 0.10.2). Several
threads print at once, one `<<` piece at a time, so pieces of two lines
interleave (`[Gloo] Rank [Gloo] Rank 1 is connected to ...`, then `0 is
connected to ...`). `install()` points file descriptor 1 at a pipe (a pty,
where stdout is a terminal, as under Open MPI) read by a small filter
process (this file run by `python -I -S`, standard library only): it drops
the lines made only of those pieces and numbers (see `LineFilter`) and
writes everything else to the original stdout as it comes: a partial line
without a newline (a prompt) at once, unless it could still become gloo's,
then after at most HOLD_S. Bytes are passed as they are (no decoding);
memory does not grow with the output. stderr is left alone.

A process, not a thread: what was printed is in the pipe, and the filter
writes it out even when the program leaves by `os._exit` or is killed
right after printing; child processes that inherit stdout are filtered as
long as they run. The filter ignores SIGINT, SIGTERM, SIGHUP, SIGUSR1 and
SIGUSR2 (a terminal's Ctrl-C, a scheduler's signal to every process of a
job) and ends when every writer has closed the pipe. At a normal exit the
program puts its original stdout back and waits (up to CLOSE_TIMEOUT_S)
for the filter to end. Should the filter die, the program's stdout is put
back as it was (what the pipe held then is lost).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import os
import re
import select
import signal
import subprocess
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
# How long the process waits at exit for the filter to write out the rest.
CLOSE_TIMEOUT_S = 2.0


def could_be_gloo(start: bytes) -> bool:
  """Whether a line that starts with `start` could still be one of gloo's."""
  words = _WORDS.match(start)  # (it matches every string, maybe empty)
  rest = start[words.end():] if words else start
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


def copy(read_end: int, out: int) -> None:
  """Copies `read_end` to `out` until EOF, less gloo's lines; should filtering fail, unfiltered from then on (in order). Bytes `out` no longer takes are dropped, and reading goes on."""
  lines, transform = LineFilter(), None
  ok = True
  poller = select.poll()
  poller.register(read_end, select.POLLIN)
  while True:
    if not poller.poll(HOLD_S * 1000 if lines.held else None):
      ok = ok and _write_all(out, lines.release())
      continue
    try:
      data = os.read(read_end, _READ)
    except OSError as e:  # A pty whose last writer is gone: EIO, not EOF.
      if e.errno != errno.EIO:
        raise
      data = b''
    if not data:
      _write_all(out, lines.release())
      return
    try:
      chunk = (transform or lines.feed)(data)
    except Exception:  # noqa: BLE001  A bug here must not lose output.
      chunk, lines, transform = lines.held + data, LineFilter(), bytes
    ok = ok and _write_all(out, chunk)


class StdoutFilter:
  """File descriptor `fd` through a pipe to a filter process that drops gloo's lines."""

  def __init__(self, fd: int = 1) -> None:
    self.fd = fd
    self.pid = os.getpid()
    self.closing = False
    self.original = os.dup(fd)  # os.dup and os.pipe: not inherited on exec.
    read_end, write_end = _channel(self.original)
    try:
      self.proc = subprocess.Popen(
          [sys.executable, '-I', '-S', os.path.abspath(__file__)],
          stdin=read_end, stdout=self.original, close_fds=True)
    except BaseException:
      for end in (read_end, write_end, self.original):
        os.close(end)
      raise
    os.close(read_end)
    self.channel = _identity(write_end)
    os.dup2(write_end, fd)
    os.close(write_end)
    self.watcher = threading.Thread(target=self._watch, daemon=True,
                                    name='multihost-stdout-filter')
    self.watcher.start()

  def _watch(self) -> None:
    """Should the filter die, puts the original stdout back (no writer blocks or fails)."""
    self.proc.wait()
    if not self.closing:
      self._put_back()

  def _put_back(self) -> None:
    """The original stdout at `fd` again, unless something else (pytest's capture) has replaced the pipe there since."""
    try:
      if _identity(self.fd) == self.channel:
        os.dup2(self.original, self.fd)
    except OSError:
      pass

  def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
    """Puts the original stdout back and waits (up to `timeout` s) for the filter to write out the rest.

    Children that inherited the pipe keep the filter running until they
    close it; this does not wait for them beyond `timeout`.
    """
    if os.getpid() != self.pid or self.closing:
      return
    try:
      sys.stdout.flush()
    except (OSError, ValueError):
      pass
    self.closing = True
    self._put_back()  # This process's write end closes here.
    try:
      self.proc.wait(timeout)
    except subprocess.TimeoutExpired:
      pass
    os.close(self.original)


def _identity(fd: int) -> tuple[int, int]:
  """What `fd` is open on (device, inode)."""
  info = os.fstat(fd)
  return info.st_dev, info.st_ino


# The filter of this process's stdout, once installed (one at most).
_INSTALLED: list[StdoutFilter] = []


def install() -> bool:
  """Filters gloo's lines out of this process's stdout from now on; returns whether it does.

  Idempotent. Not where stdout is closed or no Python interpreter can be
  started (`sys.executable` empty).
  """
  if _INSTALLED:
    return True
  try:
    os.fstat(1)
  except OSError:
    return False
  if not sys.executable:
    return False
  try:
    sys.stdout.flush()
  except (OSError, ValueError, AttributeError):
    pass
  try:
    stdout = StdoutFilter(1)
  except OSError:
    return False
  _INSTALLED.append(stdout)
  atexit.register(stdout.close)
  return True


def main() -> None:
  """The filter process: stdin to stdout, less gloo's lines, until every writer has closed stdin."""
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1,
              signal.SIGUSR2):
    signal.signal(sig, signal.SIG_IGN)
  copy(0, 1)


if __name__ == '__main__':
  main()
