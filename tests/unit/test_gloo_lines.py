"""The gloo line filter (`multihost._src.diagnostics.gloo_lines`, `python -m multihost.launch.quiet`) on real pipes.

The lines are gloo's as jaxlib 0.10.2 prints them, whole and interleaved as
seen under the launcher; each test also checks the neighbours the filter
must keep, byte for byte.
"""

from __future__ import annotations

import os
import pathlib
import select
import subprocess
import sys
import threading
import time

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


def _quiet(data: bytes, **env: str) -> subprocess.CompletedProcess:
  """`python -m multihost.launch.quiet` with `data` on stdin."""
  return subprocess.run(
      [sys.executable, '-m', 'multihost.launch.quiet'], input=data, cwd=ROOT,
      env={**os.environ, **env}, capture_output=True, timeout=60, check=False)


def test_the_command_drops_gloo_lines_unless_told_not_to():
  text = b''.join([KEPT[0], LINE, INTERLEAVED, *KEPT[1:], LINE, b'end'])
  done = _quiet(text)
  assert (done.returncode, done.stdout, done.stderr) == (
      0, b''.join(KEPT) + b'end', b'')
  done = _quiet(text, MULTIHOST_QUIET_GLOO='0')
  assert (done.returncode, done.stdout) == (0, text)


def test_a_writer_into_the_command_sees_a_closed_pipe():
  # `program | python -m multihost.launch.quiet | head -1`: the program
  # gets EPIPE (BrokenPipeError) soon after head has left, as without it.
  program = ('import sys\n'
             'try:\n'
             '  for i in range(10_000_000):\n'
             '    print("line", i, flush=True)\n'
             'except BrokenPipeError:\n'
             '  sys.stderr.write(f"EPIPE after {i} lines\\n")\n'
             '  sys.stderr.close()\n'
             '  sys.exit(0)\n')
  done = subprocess.run(
      ['bash', '-c', f'"$0" -c \'{program}\' | "$0" -m multihost.launch.quiet'
       ' | head -1; echo "${PIPESTATUS[@]}" >&2', sys.executable], cwd=ROOT,
      capture_output=True, text=True, timeout=60, check=False)
  assert done.stdout == 'line 0\n', done
  assert done.stderr.startswith('EPIPE after '), done.stderr
  assert done.stderr.splitlines()[-1] == '0 0 0', done.stderr


def test_a_failed_write_loses_only_itself_and_is_said_once(capfd):
  # stdout that takes nothing for a while (a full disk; here a full
  # non-blocking pipe, EAGAIN): what came then is lost, said once on
  # stderr; what comes once it takes bytes again arrives.
  in_r, in_w = os.pipe()
  out_r, out_w = os.pipe()
  os.set_blocking(out_w, False)
  fill = b'f' * 4096
  while True:
    try:
      os.write(out_w, fill)
    except BlockingIOError:
      break
  reader = threading.Thread(target=gloo_lines.copy, args=(in_r, out_w),
                            kwargs={'name': 'test'})
  reader.start()
  try:
    for i in range(3):
      os.write(in_w, b'lost %d\n' % i)
      time.sleep(0.1)
    drained = b''
    while (chunk := _read(out_r, 0.2, size=1 << 16)):
      drained += chunk
    assert set(drained) == {ord('f')}
    os.write(in_w, b'after\n' + LINE + b'more\n')
    assert _read(out_r, 10.0, size=11) == b'after\nmore\n'
  finally:
    os.close(in_w)
    reader.join(10)
    for fd in (in_r, out_r, out_w):
      os.close(fd)
  assert not reader.is_alive()
  err = capfd.readouterr().err
  assert err.count('test: cannot write to stdout') == 1, err


def test_the_launcher_reads_whole_lines():
  lines = gloo_lines.LineFilter()
  assert lines.line(LINE) == b''
  assert lines.line(b'kept\n') == b'kept\n'
  assert lines.line(b'[Gloo] Rank 1', last=True) == b'[Gloo] Rank 1'


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
