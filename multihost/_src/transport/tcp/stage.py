"""Data plane: a process's staging memory, which its local peers map read-only (`Stage`), and how a local link's handshake passes it (`exchange`).

Each process with local links makes one stage at its plane's start:
`STAGE_BYTES` of a memfd (pages are used only when written), sealed so
that nobody can shrink or grow it (a peer's read never finds its mapping
cut short) nor write it but through the mapping its process made before
sealing it. A local link's handshake passes each side's stage to the
other over the authenticated socket (SCM_RIGHTS), as a descriptor opened
read-only: only the job's proven processes on this host map it, and none
can write it (not even through a descriptor opened again read-write).
`transport.tcp.shared` broadcasts through it. Linux 5.1 or later (the
seals); elsewhere a process has no stage, and its links none.

Memory: the pages a stage's owner wrote stay with it (shared memory: the
owner's RSS counts them, and its peers' once they read them), at most
`STAGE_BYTES` a process, and none for a process that never was the source
of a broadcast through it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket

import numpy as np

# Two slots of this many bytes: a broadcast's pieces go through them in
# turn (`transport.tcp.shared`).
SLOT_BYTES = 4 << 20
STAGE_BYTES = 2 * SLOT_BYTES
# Nobody may shrink or grow a stage, nor write it but through the mapping
# its process made before sealing it (F_SEAL_FUTURE_WRITE, Linux 5.1: a
# peer that opens its descriptor again read-write, through /proc, can
# neither write nor map it writable). Python names it from 3.12 on.
_SEALS = (getattr(fcntl, 'F_SEAL_SHRINK', 0) | getattr(fcntl, 'F_SEAL_GROW', 0)
          | getattr(fcntl, 'F_SEAL_SEAL', 0)
          | getattr(fcntl, 'F_SEAL_FUTURE_WRITE', 0x10))
_HAS = b'\x01'  # a handshake's stage message: a descriptor comes with it
_NONE = b'\x00'


class Stage:
  """This process's staging memory: `STAGE_BYTES` of a sealed memfd, mapped writable here; `shared_fd` opens it read-only for peers."""

  def __init__(self):
    fd = os.memfd_create('multihost-stage',
                         os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
      os.ftruncate(fd, STAGE_BYTES)
      self.memory = mmap.mmap(fd, STAGE_BYTES)
      fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # (after the mapping)
      # A description of its own, read-only: what peers get.
      self.shared_fd = os.open(f'/proc/self/fd/{fd}',
                               os.O_RDONLY | os.O_CLOEXEC)
    finally:
      os.close(fd)
    self.array = np.frombuffer(self.memory, np.uint8)

  @classmethod
  def make(cls) -> Stage | None:
    """A new stage, or None where this system cannot make one (not Linux, no memfd, no /proc)."""
    if not hasattr(os, 'memfd_create') or not hasattr(fcntl, 'F_ADD_SEALS'):
      # (Not Linux. An older kernel refuses the seals: OSError below.)
      return None
    try:
      return cls()
    except (OSError, ValueError):
      return None

  def close(self) -> None:
    os.close(self.shared_fd)
    del self.array  # (its view of the mapping, which may then close)
    try:
      self.memory.close()
    except BufferError:  # (a view still in use: freed with it)
      pass


class PeerStage:
  """A local peer's stage, mapped read-only here."""

  def __init__(self, fd: int):
    """Maps the stage behind `fd` (this object's, closed here).

    Raises:
      ValueError: `fd` is not a stage (its size or seals are not a stage's).
    """
    try:
      try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
      except OSError as e:  # (not a memfd: a pipe, a socket, a file)
        raise ValueError(
            f'the peer passed a descriptor that is not a stage ({e})') from e
      size = os.fstat(fd).st_size
      if seals & _SEALS != _SEALS or size != STAGE_BYTES:
        raise ValueError(
            f'the peer passed a descriptor that is not a stage: size {size}, '
            f'seals {seals:#x}')
      self.memory = mmap.mmap(fd, STAGE_BYTES, prot=mmap.PROT_READ)
    finally:
      os.close(fd)
    self.array = np.frombuffer(self.memory, np.uint8)


def exchange(conn: socket.socket, stage: Stage | None) -> PeerStage | None:
  """Both halves of a local link's stage exchange (each side sends, then reads): the peer's stage when both sides have one, else None.

  `conn` has the handshake's timeout. Raises OSError (the connection
  failed or timed out) or ValueError (the peer's message is not a stage's).
  """
  if stage is None:
    conn.sendall(_NONE)
  else:
    socket.send_fds(conn, [_HAS], [stage.shared_fd])
  message, fds, _, _ = socket.recv_fds(conn, 1, 1)
  if not message:
    raise ConnectionResetError('the peer closed the connection')
  # (A stage's message whose descriptor did not come, as when this process
  # is out of descriptors, is refused, so that both ends of a link always
  # give the same answer.)
  valid = message in (_HAS, _NONE) and (message == _HAS) == (len(fds) == 1)
  if not valid or stage is None:  # (no descriptor kept)
    for fd in fds:
      os.close(fd)
  if not valid:
    raise ValueError(f'not a stage message: {message!r} with {len(fds)} '
                     'descriptors')
  if message == _NONE or stage is None:
    return None
  return PeerStage(fds[0])
