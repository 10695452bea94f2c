"""The stage a local link's handshake passes (`transport.tcp.stage`): real memfds over a real socketpair."""

from __future__ import annotations

import mmap
import os
import socket
import threading

import numpy as np
import pytest

from multihost._src.transport.tcp import stage as stage_lib


def _can_make() -> bool:
  stage = stage_lib.Stage.make()
  if stage is not None:
    stage.close()
  return stage is not None


pytestmark = pytest.mark.skipif(
    not _can_make(),
    reason='this system cannot make a stage (memfd_create, its seals and '
    '/proc are Linux 5.1\'s)')


def _exchange(stages):
  """Runs both halves of the exchange over a socketpair; returns each side's answer (or exception)."""
  a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
  for s in (a, b):
    s.settimeout(5)
  got = [None, None]

  def side(i, conn):
    try:
      got[i] = stage_lib.exchange(conn, stages[i])
    except (OSError, ValueError) as e:
      got[i] = e

  threads = [threading.Thread(target=side, args=(i, c))
             for i, c in enumerate((a, b))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(10)
  a.close()
  b.close()
  return got


def test_each_side_maps_the_others_stage_read_only_and_sees_its_writes():
  stages = [stage_lib.Stage(), stage_lib.Stage()]
  try:
    peers = _exchange(stages)
    for i in (0, 1):
      assert isinstance(peers[i], stage_lib.PeerStage), peers[i]
      mine, theirs = stages[i], peers[1 - i]
      mine.array[:5] = np.arange(5) + 10 * i
      np.testing.assert_array_equal(theirs.array[:5], np.arange(5) + 10 * i)
      with pytest.raises(ValueError, match='read-only'):
        theirs.array[0] = 1
      with pytest.raises(TypeError):
        theirs.memory[0] = 1
  finally:
    for s in stages:
      s.close()


def test_a_side_without_a_stage_makes_both_answers_none():
  stage = stage_lib.Stage()
  try:
    assert _exchange([stage, None]) == [None, None]
    assert _exchange([None, None]) == [None, None]
  finally:
    stage.close()


def test_a_descriptor_that_is_not_a_stage_is_refused():
  """A peer that passes another memfd (unsealed), a pipe, an unknown message, or a stage's message without its descriptor is refused with ValueError, and nothing is mapped."""
  stage = stage_lib.Stage()
  a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
  a.settimeout(5)
  b.settimeout(5)
  other = os.memfd_create('not-a-stage')
  try:
    os.ftruncate(other, stage_lib.STAGE_BYTES)
    socket.send_fds(b, [b'\x01'], [other])
    with pytest.raises(ValueError, match='not a stage: size 8388608, seals'):
      stage_lib.exchange(a, stage)
    b.recv(1)  # (what the refusing side sent)
    read, write = os.pipe()
    try:
      socket.send_fds(b, [b'\x01'], [read])
      with pytest.raises(ValueError, match='not a stage'):
        stage_lib.exchange(a, stage)
    finally:
      os.close(read)
      os.close(write)
    b.recv(1)
    socket.send_fds(b, [b'\x02'], [])
    with pytest.raises(ValueError, match='not a stage message'):
      stage_lib.exchange(a, stage)
    b.recv(1)
    b.sendall(b'\x01')  # a stage's message whose descriptor did not come
    with pytest.raises(ValueError, match='with 0 descriptors'):
      stage_lib.exchange(a, stage)
  finally:
    os.close(other)
    a.close()
    b.close()
    stage.close()


def test_a_peer_can_neither_write_resize_nor_map_writable_a_stage():
  """Even through its descriptor opened again read-write (/proc): only the owner's own mapping writes."""
  stage = stage_lib.Stage()
  try:
    fd = os.open(f'/proc/self/fd/{stage.shared_fd}', os.O_RDWR)
    try:
      for size in (0, stage_lib.STAGE_BYTES + 4096):
        with pytest.raises(PermissionError):
          os.ftruncate(fd, size)
      with pytest.raises(PermissionError):
        os.pwrite(fd, b'x', 0)
      with pytest.raises(PermissionError):
        mmap.mmap(fd, stage_lib.STAGE_BYTES)
    finally:
      os.close(fd)
    stage.array[0] = 7  # The owner's mapping, made before the seals.
    assert stage.array[0] == 7
  finally:
    stage.close()
