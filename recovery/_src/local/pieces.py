"""Object all-gathers of any size: pickled, then sent in pieces that each fit `multihost.allgather_object`'s limit.

`multihost.allgather_object` refuses an object whose pickle is over
$MULTIHOST_MAX_OBJECT_BYTES (1 GiB by default) on every process. The local
tier moves a host's blocks (gigabytes, for a large sharded model), so it
sends them here: each process pickles its object once (protocol 5: its
arrays' bytes stay where they are, out of band) and announces its length
with its first piece, then every process sends the same number of pieces,
each at most `piece_bytes()`, in as many all-gathers (one in all for small
objects). Each piece is sealed and checked
as any object is. A process keeps the pieces of the processes it asks for
(`keep`) and drops the others as they come, so what it holds is what it
needs.
"""

from __future__ import annotations

from collections.abc import Callable
import pickle
import struct
from typing import Any

import jax

import multihost

# The largest piece: small enough that one all-gather of a piece from every
# process is no burden on a host's memory, large enough that few calls move
# a gigabyte.
MAX_PIECE = 64 << 20
_COUNT = struct.Struct('<QQ')  # the pickle's length, how many buffers
_LENGTH = struct.Struct('<Q')


def piece_bytes() -> int:
  """The bytes of one piece: below the object limit with room for the pickle's framing of a bytes object."""
  limit = multihost.max_object_bytes()
  return max(1, min(MAX_PIECE, limit - 1024 if limit > 2048 else limit // 2))


def allgather(obj: Any, *, keep: Callable[[int], bool] | None = None
              ) -> list[Any]:
  """Every process's `obj`, in process order; None for the processes `keep` rejects (default: keep all).

  Collective: every process must call this, in the same order. Any size:
  see the module docstring.

  Raises:
    multihost.MultihostError: what `multihost.allgather_object` raises.
  """
  me = jax.process_index()
  if jax.process_count() == 1:
    return [obj if keep is None or keep(me) else None]
  buffers: list[pickle.PickleBuffer] = []
  head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
  views = [b.raw() for b in buffers]
  segments = [_COUNT.pack(len(head), len(views)),
              *(_LENGTH.pack(v.nbytes) for v in views), head, *views]
  total = sum(memoryview(s).nbytes for s in segments)
  size = piece_bytes()
  # The first piece travels with the length: one call for a small object.
  first = multihost.allgather_object((total, _cut(segments, 0, size)))
  totals = [t for t, _ in first]
  kept = [p for p in range(len(totals))
          if p != me and (keep is None or keep(p))]
  received = {p: bytearray(totals[p]) for p in kept}
  for p in kept:
    received[p][:len(first[p][1])] = first[p][1]
  del first
  for r in range(1, max(-(-t // size) for t in totals)):
    got = multihost.allgather_object(_cut(segments, r * size, size))
    for p in kept:
      piece = got[p]
      received[p][r * size:r * size + len(piece)] = piece
  out: list[Any] = [None] * len(totals)
  if keep is None or keep(me):
    out[me] = obj
  for p, data in received.items():
    out[p] = _loads(memoryview(data))
  return out


def _cut(segments: list, start: int, length: int) -> bytes:
  """Bytes [start, start + length) of the segments laid end to end."""
  out, at = [], 0
  for s in segments:
    s = memoryview(s).cast('B')
    end = at + s.nbytes
    if end > start and at < start + length:
      out.append(s[max(0, start - at):min(s.nbytes, start + length - at)])
    at = end
  return b''.join(out)


def _loads(data: memoryview) -> Any:
  """The object a process's bytes (`allgather`'s layout) hold; its arrays are views of `data`."""
  head_len, count = _COUNT.unpack_from(data)
  at = _COUNT.size
  lengths = [_LENGTH.unpack_from(data, at + i * _LENGTH.size)[0]
             for i in range(count)]
  at += count * _LENGTH.size
  head = data[at:at + head_len]
  at += head_len
  buffers = []
  for n in lengths:
    buffers.append(data[at:at + n])
    at += n
  return pickle.loads(head, buffers=buffers)
