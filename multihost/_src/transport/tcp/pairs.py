"""Data plane: a point-to-point exchange over the TCP links (each byte only over the link between its sender and its receiver).

Every process sends one frame to each of its destinations and reads one
frame from each of its sources, on lane 0 of the links between them: no
byte passes through a third process. The sends go out from the caller's
own buffers (no copy) on the plane's send thread while the calling thread
reads, each into one result buffer (no copy either). Both go in the order
of the ring offset: a process sends to me+1, me+2, ... and reads from
me-1, me-2, .... A send that waits is waiting for a reader at a smaller
offset, which waits for a sender at a smaller offset or equal (its own
pair, which moves), so the waits cannot close a cycle: the exchange
cannot deadlock, whatever the pattern.
"""

from __future__ import annotations

import time

import numpy as np

from multihost._src.runtime import errors
from multihost._src.runtime.deadline import Deadline
from multihost._src.transport import buffers
from multihost._src.transport.tcp import link as _tcp_link
from multihost._src.transport.tcp import payload
from multihost._src.transport.tcp import threads


def length(segments: list) -> int:
  """The bytes of `segments` (bytes-like objects), laid end to end."""
  return sum(memoryview(s).nbytes for s in segments)


def exchange(sends: dict[int, list], incoming: dict[int, int], *, op: str,
             timeout: float) -> dict[int, np.ndarray]:
  """Sends each destination its segments; returns each source's bytes.

  Collective over the processes named: every process in `sends` must
  call this with this process in its `incoming`, with the length sent, and
  every process in `incoming` with this process in its `sends` (the
  caller's agreement proves that before any byte moves).

  Args:
    sends: destination process -> bytes-like segments (C-contiguous),
      sent in order, from their own memory.
    incoming: source process -> the bytes it sends here.
    op: the call's name, for errors.
    timeout: seconds for the whole transfer.

  Returns:
    source process -> its bytes (uint8, from the result pool).

  Raises:
    CollectiveTimeoutError: a peer did not send or read in time (named).
    ProcessFailureError: a peer is gone.
    MultihostError: a peer's frame was refused.
  """
  deadline = time.monotonic() + timeout
  plane = _tcp_link.get_plane(op, deadline)
  me, count, call = plane.me, plane.count, plane.seq
  out_order = sorted(sends, key=lambda d: (d - me) % count)
  in_order = sorted(incoming, key=lambda s: (me - s) % count)
  sizes = {d: length(sends[d]) for d in out_order}
  watch = Deadline(op, deadline, plane.rt.watchdog)
  pipe = threads.sender(watch, max(sizes.values(), default=0), plane.sends)
  # The sender `payload.failed` stops, if the exchange fails before it closed.
  sender: threads.Sender | threads.DirectSender | None = pipe
  received: dict[int, np.ndarray] = {}
  peer = (out_order or in_order or [me])[0]
  try:
    for dest in out_order:
      peer = dest
      down = plane.conn(dest, deadline, op)
      payload.arm(down, deadline)
      pipe.send(down.sock, down.frame(call, sizes[dest]))
      for segment in sends[dest]:
        view = memoryview(segment).cast('B')
        for at in range(0, len(view), payload.CHUNK):
          pipe.send(down.sock, view[at:at + payload.CHUNK])
    for source in in_order:
      peer = source
      up = plane.conn(source, deadline, op)
      payload.arm(up, deadline)
      out = buffers.take(incoming[source])
      up.read_frame_into(call, out.data, op, source, watch)
      received[source] = out
    if out_order:
      peer = out_order[-1]
    sender = None
    pipe.close(deadline)
  except (OSError, TimeoutError, errors.MultihostError) as e:
    raise payload.failed(plane, sender, op, peer, e,
                         deadline=deadline) from e
  return received
