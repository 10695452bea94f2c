"""The one file writer (`multihost.files.write_atomic`) and the writers that use it: whole files, nothing left on failure, never through a link."""

from __future__ import annotations

import errno
import json
import os

import pytest

import multihost
from multihost import files as public_files
from multihost._src.runtime import files
from multihost._src.runtime import flight
from multihost.launch._src.report import report as _report
from multihost.launch._src.run import trace as _trace


@pytest.fixture
def umask_022():
  old = os.umask(0o022)
  try:
    yield
  finally:
    os.umask(old)


def _names(folder):
  return sorted(os.listdir(folder))


# --- write_atomic ------------------------------------------------------------

def test_write_atomic_replaces_the_file_whole(tmp_path):
  path = tmp_path / 'state.json'
  path.write_text('old contents')
  with open(path) as reader:  # A reader that opened the old file...
    public_files.write_atomic(path, 'new')
    assert reader.read() == 'old contents'  # ...reads it whole.
  assert path.read_text() == 'new'
  public_files.write_atomic(str(path), b'\x00bytes\xff')
  assert path.read_bytes() == b'\x00bytes\xff'
  public_files.write_atomic(path, b'')
  assert path.read_bytes() == b''
  assert _names(tmp_path) == ['state.json']  # No temporary file left.


def test_write_atomic_into_a_missing_folder_names_the_target(tmp_path):
  path = tmp_path / 'missing' / 'state.json'
  with pytest.raises(FileNotFoundError) as raised:
    public_files.write_atomic(path, 'data')
  # The target, not the random temporary name.
  assert raised.value.filename == str(path)
  assert str(path) in str(raised.value)
  assert _names(tmp_path) == []


def test_write_atomic_leaves_no_temporary_file_when_the_data_raises(tmp_path):
  path = tmp_path / 'state.json'
  path.write_text('old')
  with pytest.raises(TypeError):
    public_files.write_atomic(path, object())  # Not bytes: the write raises.
  assert path.read_text() == 'old'
  assert _names(tmp_path) == ['state.json']


def test_write_atomic_leaves_the_target_and_no_temporary_file_on_a_full_disk(
    tmp_path, monkeypatch):
  path = tmp_path / 'state.json'
  path.write_text('old')

  def full(fd):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(os, 'fsync', full)
  with pytest.raises(OSError) as raised:
    public_files.write_atomic(path, 'new')
  assert raised.value.errno == errno.ENOSPC
  assert path.read_text() == 'old'
  assert _names(tmp_path) == ['state.json']


def test_write_atomic_replaces_a_link_at_the_target_never_its_target(
    tmp_path):
  victim = tmp_path / 'victim'
  victim.write_text('precious')
  path = tmp_path / 'state.json'
  path.symlink_to(victim)
  public_files.write_atomic(path, 'new')
  assert victim.read_text() == 'precious'
  assert not path.is_symlink() and path.read_text() == 'new'


def test_write_atomic_refuses_a_link_at_its_temporary_name(tmp_path,
                                                           monkeypatch):
  # The name is random; pretend an attacker guessed it.
  monkeypatch.setattr(files.secrets, 'token_hex', lambda n: 'ab' * n)
  path = tmp_path / 'state.json'
  victim = tmp_path / 'victim'
  victim.write_text('precious')
  (tmp_path / f'.state.json.tmp-{"ab" * 8}').symlink_to(victim)
  with pytest.raises(FileExistsError):
    public_files.write_atomic(path, 'new')
  assert victim.read_text() == 'precious'
  assert not path.exists()


def test_the_temporary_name_is_unpredictable_and_beside_the_target(tmp_path):
  names = {files.temporary_name(tmp_path / 'f') for _ in range(100)}
  assert len(names) == 100
  assert all(os.path.dirname(n) == str(tmp_path) for n in names)


def test_write_atomic_sets_the_mode_bits(tmp_path, umask_022):
  path = tmp_path / 'f'
  public_files.write_atomic(path, 'x')
  assert path.stat().st_mode & 0o7777 == 0o644
  public_files.write_atomic(path, 'x', mode=0o600)  # Replacing: the new mode.
  assert path.stat().st_mode & 0o7777 == 0o600
  public_files.write_atomic(path, 'x', mode=0o666)  # Then the umask applies.
  assert path.stat().st_mode & 0o7777 == 0o644
  public_files.write_atomic(path, 'x', mode=0o640, sync=False)
  assert path.stat().st_mode & 0o7777 == 0o640
  assert _names(tmp_path) == ['f']


# --- Finding 9: every writer goes through it ---------------------------------

def _launcher_trace(path):
  result = _report.LaunchResult(
      returncodes=(0,), outputs=('',), pids=(1,), end_times=(0.1,),
      first_failure=None, stopped=(), timed_out=False,
      still_running_at_timeout=(), interrupted_by=None, exit_code=0,
      summary='')
  dumps = path.parent / 'dumps'
  dumps.mkdir()
  _trace.write(str(path), str(dumps), result, num_processes=1,
               run_wall0=0.0, starts=[0.0])


def _write_trace(path):
  multihost.write_trace(path)  # One controller: this pytest process.


def _flight_dump(path):
  flight.Recorder().dump(str(path), 0)


@pytest.mark.parametrize('writer, old_temporary', [
    (_launcher_trace, '{path}.tmp'),  # multihost.launch --trace
    (_write_trace, '{path}.tmp'),  # multihost.write_trace
    (_flight_dump, '{path}.{pid}.tmp'),  # a controller's dump at exit
])
def test_a_writer_never_writes_through_a_planted_link(tmp_path, writer,
                                                      old_temporary):
  """Links planted in a shared folder at the old predictable temporary name and at the target."""
  shared = tmp_path / 'shared'
  shared.mkdir()
  path = shared / 'run.json'
  victims = {}
  for name, at in [('victim-tmp', old_temporary.format(path=path,
                                                        pid=os.getpid())),
                   ('victim-target', str(path))]:
    victims[name] = tmp_path / name
    victims[name].write_text('precious')
    os.symlink(victims[name], at)
  writer(path)
  for victim in victims.values():
    assert victim.read_text() == 'precious', victim
  assert not path.is_symlink()
  json.loads(path.read_text())
