"""stdout's gloo filter (`multihost._src.diagnostics.gloo_lines`) on real pipes and file descriptors.

The lines are gloo's as jaxlib 0.10.2 prints them, whole and interleaved as
seen under the launcher; each test also checks the neighbours the filter
must keep, byte for byte.
"""

from __future__ import annotations

import os
import pathlib
import select
import signal
import subprocess
import sys
import threading
import time
import tty

from multihost._src.diagnostics import gloo_lines

ROOT = pathlib.Path(__file__).resolve().parents[2]
LINE = (b'[Gloo] Rank 3 is connected to 3 peer ranks. Expected number of '
        b'connected peer ranks is : 3\n')
# Two threads' lines, interleaved piece by piece (seen under the launcher).
INTERLEAVED = (b'[Gloo] Rank [Gloo] Rank 1 is connected to 3 peer ranks. '
               b'Expected number of connected peer ranks is : 3\n0 is '
               b'connected to 3 peer ranks. Expected number of connected '
               b'peer ranks is : 3\n')
KEPT = [
    b'user: [Gloo] Rank 3 is connected to 3 peer ranks. Expected number of '
    b'connected peer ranks is : 3\n',
    b'[Gloo] Rank 3 is connected to 3 peer ranks (my own words)\n',
    b'Gloo is connected to 3 peer ranks.\n',
    b'12345\n', b'\n', b'\xff\x00binary\r\n',
]


def _filtered(chunks: list[bytes]) -> bytes:
  lines = gloo_lines.LineFilter()
  return b''.join(lines.feed(c) for c in chunks) + lines.release()


def test_whole_and_interleaved_gloo_lines_go_and_the_rest_stays():
  text = b''.join([KEPT[0], LINE, INTERLEAVED, *KEPT[1:], LINE])
  expected = b''.join(KEPT)
  assert _filtered([text]) == expected
  # Cut anywhere (one byte at a time, and at every position): the same.
  assert _filtered([text[i:i + 1] for i in range(len(text))]) == expected
  for cut in range(len(text)):
    assert _filtered([text[:cut], text[cut:]]) == expected, cut
  # A third thread's piece inside a line, and its rest on the next.
  assert _filtered([b'[Gloo] Rank 1 is connected to 3 peer ranks. Expected '
                    b'number of connected peer ranks is : 3[Gloo] Rank 2\n'
                    b' is connected to 3 peer ranks. Expected number of '
                    b'connected peer ranks is : 3\nafter\n']) == b'after\n'


def test_partial_lines_come_out_at_once_unless_they_could_be_gloo():
  lines = gloo_lines.LineFilter()
  assert lines.feed(b'Password: ') == b'Password: '  # A prompt: at once.
  assert lines.feed(b'more') == b'more'
  assert lines.feed(b'\n[Gloo] Ra') == b'\n'  # Could be gloo's: held.
  assert lines.release() == b'[Gloo] Ra'  # Nothing more came: as it is.
  assert lines.feed(b'nk 3 is connected to 3\n') == b'nk 3 is connected to 3\n'
  # Memory stays bounded: a long line of digits is held up to MAX_HELD.
  assert lines.feed(b'7' * gloo_lines.MAX_HELD) == b''
  assert lines.feed(b'7') == b'7' * (gloo_lines.MAX_HELD + 1)
  assert len(lines.held) == 0
  assert lines.feed(b'7' * 10_000_000) == b'7' * 10_000_000


def _read(fd: int, seconds: float, *, size: int | None = None) -> bytes:
  """What `fd` gives until EOF, `size` bytes or `seconds`."""
  got, deadline = b'', time.monotonic() + seconds
  while (left := deadline - time.monotonic()) > 0 and (
      size is None or len(got) < size):
    if select.select([fd], [], [], left)[0]:
      chunk = os.read(fd, 1 << 16)
      if not chunk:
        break
      got += chunk
  return got


def test_a_real_fd_through_the_filter_from_several_threads():
  out_r, out_w = os.pipe()
  stdout = gloo_lines.StdoutFilter(out_w)
  try:
    os.write(out_w, b'before\nPrompt> ')
    # A partial line that cannot be gloo's comes out while the filter runs.
    assert _read(out_r, 1.0, size=15) == b'before\nPrompt> '
    os.write(out_w, b'yes\n')  # (The rest of a line passes as it is.)
    # Four threads print gloo's line piece by piece (as `<<` does), while
    # the main thread writes its own lines.
    pieces = [b'[Gloo] Rank ', b'1', b' is connected to ', b'3',
              b' peer ranks. ', b'Expected number of connected peer ranks '
              b'is : ', b'3', b'\n']

    def gloo():
      for _ in range(50):
        for piece in pieces:
          os.write(out_w, piece)

    threads = [threading.Thread(target=gloo) for _ in range(4)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    os.write(out_w, b''.join(KEPT))
    stdout.close()
    os.close(out_w)
    got = _read(out_r, 10.0)
  finally:
    os.close(out_r)
  # The main thread's lines arrive whole: a thread's piece may have split
  # no line of theirs here, as all of them came after the threads ended.
  assert got == b'yes\n' + b''.join(KEPT), got[:3000]


def test_a_terminal_stays_a_terminal_and_bytes_pass_unchanged():
  # As Open MPI's ranks see their stdout: a pty (raw here, so that the
  # bytes read back are the bytes written).
  outer, terminal = os.openpty()
  tty.setraw(terminal)
  stdout = gloo_lines.StdoutFilter(terminal)
  try:
    assert os.isatty(terminal)
    os.write(terminal, b'a\n' + LINE + b'\xff\x00\r\nend')
    stdout.close()
    got = _read(outer, 1.0, size=10)
  finally:
    os.close(outer)
    os.close(terminal)
  assert got == b'a\n\xff\x00\r\nend'


def test_a_failing_filter_copies_the_rest_unfiltered_and_blocks_no_writer(
    monkeypatch):
  def broken(self, data):
    raise RuntimeError('a bug in the filter')

  monkeypatch.setattr(gloo_lines.LineFilter, 'feed', broken)
  in_r, in_w = os.pipe()
  out_r, out_w = os.pipe()
  reader = threading.Thread(target=gloo_lines.copy, args=(in_r, out_w))
  reader.start()
  try:
    big = b'x' * (1 << 20) + b'\n'  # Far more than a pipe holds.
    writer = threading.Thread(target=lambda: os.write(in_w, big) and
                              os.write(in_w, LINE))
    writer.start()
    got = _read(out_r, 30.0, size=len(big) + len(LINE))
    writer.join(10)
    assert not writer.is_alive(), f'the writer blocked after {len(got)} bytes'
    assert got == big + LINE  # Nothing lost; unfiltered from then on.
  finally:
    os.close(in_w)
    reader.join(10)
    for fd in (in_r, out_r, out_w):
      os.close(fd)
  assert not reader.is_alive()


def _program(tmp_path: pathlib.Path, body: str) -> tuple[int, bytes, bytes]:
  """Runs `body` after `gloo_lines.install()` in a fresh Python: (status, stdout to its end, stderr)."""
  script = tmp_path / 'program.py'
  # The module alone, by its path (no JAX import: seconds on a busy CPU).
  script.write_text(
      'import importlib.util, os, signal, sys, time\n'
      'spec = importlib.util.spec_from_file_location(\n'
      f'    "gloo_lines", {gloo_lines.__file__!r})\n'
      'gloo_lines = importlib.util.module_from_spec(spec)\n'
      'spec.loader.exec_module(gloo_lines)\n'
      'assert gloo_lines.install()\n' + body)
  out_r, out_w = os.pipe()
  try:
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=out_w,
                            stderr=subprocess.PIPE)
    os.close(out_w)
    out_w = -1
    # To its end: the filter, and the child it forks, have closed it.
    got = _read(out_r, 60.0)
    err = proc.communicate(timeout=60)[1]
  finally:
    os.close(out_r)
    if out_w >= 0:
      os.close(out_w)
  return proc.returncode, got, err


def test_what_was_printed_survives_a_sigkill_and_children_stay_filtered(
    tmp_path):
  rc, got, err = _program(tmp_path, (
      f'os.write(1, {LINE!r})\n'
      'if os.fork() == 0:  # Prints after its parent is gone.\n'
      '  time.sleep(0.5)\n'
      f'  os.write(1, b"\\n" + {LINE!r} + b"child after parent\\n")\n'
      '  os._exit(0)\n'
      'for i in range(2000):\n'
      '  print("line", i)\n'
      'sys.stdout.write("no newline")\n'
      'sys.stdout.flush()\n'
      'os.kill(os.getpid(), signal.SIGKILL)\n'))
  assert rc == -signal.SIGKILL, err
  assert got == (b''.join(b'line %d\n' % i for i in range(2000)) +
                 b'no newline\nchild after parent\n'), (got[-500:], err)


def test_a_dead_filter_gives_the_program_its_stdout_back(tmp_path):
  rc, got, err = _program(tmp_path, (
      'print("a", flush=True)\n'
      'time.sleep(0.5)\n'
      'stdout = gloo_lines._INSTALLED[0]\n'
      'os.kill(stdout.proc.pid, signal.SIGKILL)\n'
      'stdout.watcher.join(10)\n'
      f'print("b", flush=True); os.write(1, {LINE!r})\n'))
  assert rc == 0, err
  # "a" is lost if the filter had not copied it yet (a busy CPU can hold
  # a new Python's start back that long); what follows comes out as it is.
  assert got in (b'a\nb\n' + LINE, b'b\n' + LINE), (got, err)


def test_only_the_exact_form_or_pieces_of_an_open_line_go():
  # The exact form goes, whoever prints it.
  assert _filtered([LINE]) == b''
  # Later pieces, numbers or nothing, while no gloo line is open: kept.
  alone = [b'0 is connected to 3 peer ranks. Expected number of connected '
           b'peer ranks is : 3\n', b'3\n', b'\n']
  assert _filtered(alone) == b''.join(alone)
  # The same after a line that opened two and closed one: they go.
  opened = b'[Gloo] Rank [Gloo] Rank 1 is connected to 3\n'
  assert _filtered([opened, alone[0], b'kept\n']) == b'kept\n'
  assert _filtered([opened, b'3\n', b'3\n']) == b'3\n'
