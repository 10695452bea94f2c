"""Data plane: a broadcast among processes of one host through the source's stage (`tcp.stage`), which its peers map read-only.

Why: over a local socket each hop copies the payload twice (into the
kernel and out) and a tree forwards it once per level, so at P processes
on one host a broadcast moves 2(P - 1) copies through the cores the
processes share. Here the source copies each piece of the payload once
into its stage and every receiver copies it out at once: P copies in
all, and no hop waits for another (docs/performance.md, "Against the
physical floors": a 64 MiB broadcast against a raw local stream).

The transfer (`broadcast`), once the call agreed: the payload goes in
pieces (`_pieces`: at most `stage.SLOT_BYTES`, and between 2 processes
at least `PIECES` of them). For each piece the source copies it into the
stage and sends each receiver an empty frame of the call (MAC'd as every
frame: the receiver knows which bytes each piece holds from the payload's
length and the number of processes alone); each receiver copies the
piece out. A payload that fits the stage (`STAGE_BYTES`) lies in it
whole, each piece at its own offset (`_place`); a larger one goes
through the stage's two slots in turn, and before a slot takes its next
piece the source waits until every receiver released its last one (an
empty frame it answers once it copied that piece out). Nothing else is
released, and the source returns without waiting for the receivers to
copy: the next call that writes this stage is agreed first, and every
process that agreed to it has returned from this one (a receiver returns
only once its copies are done), so the stage is free again by then. So
below `STAGE_BYTES` the source never waits for a receiver, and a
receiver waits only where it caught up with the source: on cores the
processes share with other work, a receiver that was woken late finds
every piece's frame there, where releases made both sides wait on each
other once a piece. A receiver whose link has no
`shared` stage (a TCP link after all, or a side without a stage: the same
answer at both ends) gets the payload as one data frame. Every wait is
bounded by the call's deadline, and a peer that dies closes its link,
which raises at once, as for every transfer.

Used for a broadcast of at least `SHARED_FROM` bytes whose processes all
publish one host and a local socket, once calls agree over the links
(`carries`: the same answer on every process). The source's own result
is a copy of each piece out of its stage, made while the receivers copy
theirs; where its host has a core to spare (`Plane.spare_cores`), a copy
of its parts made on the plane's copier thread beside the pieces' copies
into the stage (on a 16-core machine the source, copying both, was the
slower process: a 64 MiB broadcast at 2 processes took 18.7 ms against
a raw local stream's 13.5, in a run on that machine that
docs/performance.md no longer keeps).
"""

from __future__ import annotations

import functools

import numpy as np

from multihost._src.runtime import errors
from multihost._src.runtime import leaves
from multihost._src.runtime.deadline import Deadline
from multihost._src.transport.tcp import link as _tcp_link
from multihost._src.transport.tcp import payload
from multihost._src.transport.tcp import sockets
from multihost._src.transport.tcp import stage as _stage

# A broadcast of at least this many bytes among processes of one host
# goes through the stage (`carries`).
SHARED_FROM = 256 << 10
# Between 2 processes a payload goes in at least this many pieces
# (`_pieces`), each of MIN_PIECE to `stage.SLOT_BYTES` bytes: the receiver
# copies piece k out while the source copies piece k + 1 in, so the copies
# overlap but for one piece's (a 1 MiB broadcast on 2 cores: 0.30 ms in
# one piece, 0.24 in four). Among more processes each piece costs the
# source a frame to every receiver and each receiver a wake-up, which on
# 2 cores cost more than the overlap saved (P=4, 1 MiB: CPU 0.80 -> 0.93
# ms a call), so there a piece is as large as a slot.
PIECES = 4
MIN_PIECE = 128 << 10


def carries(plane: _tcp_link.Plane, length: int) -> bool:
  """Whether a broadcast of `length` bytes goes through the source's stage: at least `SHARED_FROM` bytes, every process on one host with local links (`Plane.one_host`), calls agreeing over the links (the same answer on every process)."""
  return length >= SHARED_FROM and plane.one_host and plane.agrees


def _place(k: int, start: int, length: int) -> int:
  """Where in the stage piece `k` (from byte `start`) of a payload of `length` bytes goes: at `start` when the payload fits the stage, else in slot k % 2."""
  if length <= _stage.STAGE_BYTES:
    return start
  return (k % 2) * _stage.SLOT_BYTES


def _released(k: int, count: int, length: int) -> bool:
  """Whether a receiver releases piece `k` of `count` pieces of a payload of `length` bytes: where a slot takes another piece after it (`_place`)."""
  return length > _stage.STAGE_BYTES and k + 2 < count


def _pieces(length: int, count: int) -> list[tuple[int, int]]:
  """(start, stop) of each piece of a payload of `length` bytes among `count` processes (the same on every process); where each goes in the stage is `_place`'s."""
  size = _stage.SLOT_BYTES
  if count == 2:
    quarter = -(-length // PIECES)
    size = min(size, max(MIN_PIECE, -(-quarter // 4096) * 4096))
  return [(a, min(a + size, length)) for a in range(0, length, size)]


def broadcast(plane: _tcp_link.Plane, call: int, source: int, length: int,
              parts: list[np.ndarray] | None, out: np.ndarray | None,
              op: str, deadline: float) -> None:
  """Moves the source's `length` bytes into `out` on every process (see the module docstring).

  The source passes its `parts` (C-contiguous arrays) and its own result
  `out` (or None); every other process its result `out`.
  """
  watch = Deadline(op, deadline, plane.rt.watchdog)
  if plane.me == source:
    if parts is None:
      raise errors.MultihostError(
          f'{op}: process {plane.me}, the source, passed no parts to send.')
    _send(plane, call, length, parts, out, op, deadline, watch)
  else:
    if out is None:
      raise errors.MultihostError(
          f'{op}: process {plane.me} has no result to receive into.')
    _receive(plane, call, source, length, out, op, deadline, watch)


def _send(plane: _tcp_link.Plane, call: int, length: int,
          parts: list[np.ndarray], out: np.ndarray | None, op: str,
          deadline: float, watch: Deadline) -> None:
  """The source's half: each piece into the stage, a frame to each receiver, and, where a slot takes another piece, their releases of its last one first (`_released`; see the module docstring)."""
  peers = [p for p in range(plane.count) if p != plane.me]
  views = [part.reshape(-1).view(np.uint8).data for part in parts]
  peer = peers[0]
  try:
    links = {}
    for peer in peers:
      links[peer] = link = plane.conn(peer, deadline, op)
      payload.arm(link, deadline)
    staged = [p for p in peers if links[p].shared is not None]
    for peer in peers:  # (no stage on that link: the bytes themselves)
      link = links[peer]
      if link.shared is None:
        for segment in payload.segments(link.frame(call, length), parts):
          sockets.send_all(link.sock, segment, watch)
    if not staged:
      if out is not None:
        leaves.pack_into(out, parts)
      return
    copying = None
    if out is not None and plane.spare_cores:  # beside the copies below
      copying = plane.copier.run(functools.partial(leaves.pack_into, out,
                                                   parts))
      out = None  # (the copier's: the pieces below do not copy into it)
    if plane.stage is None:  # (a link holds a stage only if this has one)
      raise errors.MultihostError(
          f'{op}: process {plane.me} has a shared link but no stage.')
    stage = plane.stage.array
    pieces = _pieces(length, plane.count)
    for k, (start, stop) in enumerate(pieces):
      slot = _place(k, start, length)
      if k >= 2 and _released(k - 2, len(pieces), length):
        for peer in staged:  # the slot's last piece is released
          links[peer].read_frame(call, 0, op, peer, watch)
      at = slot
      for view in payload.cut(views, start, stop):
        stage[at:at + len(view)] = np.frombuffer(view, np.uint8)
        at += len(view)
      for peer in staged:
        sockets.send_all(links[peer].sock, links[peer].frame(call, 0), watch)
      if out is not None:  # while the receivers copy theirs
        out[start:stop] = stage[slot:slot + stop - start]
  except (OSError, TimeoutError, errors.MultihostError) as e:
    raise payload.failed(plane, None, op, peer, e, deadline=deadline) from e
  if copying is not None:
    copying.join(deadline)  # (a local failure: the links are as they were)


def _receive(plane: _tcp_link.Plane, call: int, source: int, length: int,
             out: np.ndarray, op: str, deadline: float,
             watch: Deadline) -> None:
  """A receiver's half: each piece out of the source's stage, then, where a slot takes another piece after it, a frame that releases it (`_released`)."""
  try:
    link = plane.conn(source, deadline, op)
    payload.arm(link, deadline)
    if link.shared is None:
      link.read_frame(call, length, op, source, watch)
      link.recv_into(out.data, watch)
      return
    stage = link.shared.array
    pieces = _pieces(length, plane.count)
    for k, (start, stop) in enumerate(pieces):
      slot = _place(k, start, length)
      link.read_frame(call, 0, op, source, watch)
      out[start:stop] = stage[slot:slot + stop - start]
      if _released(k, len(pieces), length):  # (see the module docstring)
        sockets.send_all(link.sock, link.frame(call, 0), watch)
  except (OSError, TimeoutError, errors.MultihostError) as e:
    raise payload.failed(plane, None, op, source, e,
                         deadline=deadline) from e
