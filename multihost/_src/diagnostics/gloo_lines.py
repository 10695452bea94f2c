"""Diagnostics: gloo's connection lines, told apart from everything else in a byte stream, for the programs that read controllers' output.

JAX's CPU collectives (gloo, inside jaxlib) print one line per local device
from C++ (`std::cout`) each time they connect a new set of devices: at the
first collective of each communicator, so at any step, not only at
`initialize()`:

    [Gloo] Rank 3 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3

No JAX setting or environment variable silences it (jaxlib 0.10.2). Several
threads print at once, one `<<` piece at a time, so pieces of two lines
interleave (`[Gloo] Rank [Gloo] Rank 1 is connected to ...`, then `0 is
connected to ...`). `LineFilter` drops the lines made only of those pieces
and numbers while a gloo line is open, and passes everything else byte for
byte, in order. It runs where output is read already, never inside a
controller: the launcher's reading of each controller's output
(`multihost.launch`), and `copy`/`main` (`python -m multihost.launch.quiet`),
a pipe filter for the output of `srun` (docs/restart.sbatch) or `mpirun`.
Memory does not grow with the output.
"""

from __future__ import annotations

from collections.abc import Mapping
import errno
import os
import re
import select
import signal
import time

from multihost import env

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


def wanted(environ: Mapping[str, str]) -> bool:
  """Whether gloo's lines are to be dropped: $MULTIHOST_QUIET_GLOO of `environ` is not off (0/false/no/off)."""
  value = environ.get(env.QUIET_GLOO, '').strip().lower()
  return value not in ('0', 'false', 'no', 'off')


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

  def line(self, line: bytes, *, last: bool = False) -> bytes:
    """What to keep of one line read whole (`line` ends with its newline, unless `last`: the stream ended without one): `line` or nothing."""
    kept = self.feed(line)
    return kept + self.release() if last else kept

  def release(self) -> bytes:
    """The partial line held back, to write as it is (nothing more came)."""
    held, self.held = self.held, b''
    if held:
      self.passing = True
    return held


def _write_all(fd: int, data: bytes) -> OSError | None:
  """Writes `data` to `fd`; the error that stopped it, if one did (the rest of `data` is then not written)."""
  view = memoryview(data)
  while view:
    try:
      view = view[os.write(fd, view):]
    except InterruptedError:
      continue
    except OSError as e:
      return e
  return None


def copy(read_end: int, out: int, *, name: str = 'gloo filter',
         drop: bool = True) -> None:
  """Copies `read_end` to `out` until EOF, less gloo's lines (all of it with `drop` False); returns at once when `out` is a closed pipe (EPIPE).

  Any other failed write (ENOSPC: a full disk) loses that write's bytes,
  as the program's own write would have, and is said once on stderr
  (prefixed `name`); later writes are tried again, so lines written once
  there is space arrive. Should filtering itself fail, the rest passes
  unfiltered, in order.
  """
  lines, transform = LineFilter(), (None if drop else bytes)
  failing = False
  poller = select.poll()
  poller.register(read_end, select.POLLIN)
  while True:
    if lines.held and not poller.poll(HOLD_S * 1000):
      chunk = lines.release()
    else:
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
    error = _write_all(out, chunk)
    if error is not None and error.errno == errno.EPIPE:
      return
    if error is not None and not failing:
      os.write(2, f'{name}: cannot write to stdout ({error}); what could not '
               'be written is lost, later lines are tried again.\n'.encode())
    failing = error is not None


def main(name: str = 'gloo filter') -> None:
  """Standard input to standard output, less gloo's lines, until EOF (or until stdout is a closed pipe).

  With $MULTIHOST_QUIET_GLOO=0 it passes everything. Ignores SIGINT,
  SIGTERM and SIGHUP: a Ctrl-C or a scheduler's signal
  reaches every process of a pipeline at once, and the lines the
  programs still print after it (a preemption's "saved step N") must
  pass; this ends when the last writer closes its end.
  """
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
  copy(0, 1, name=name, drop=wanted(os.environ))
