"""Data plane: result memory that is used again once the caller lets go of it.

Why: a large numpy array is fresh anonymous memory (above malloc's mmap
threshold, every allocation maps new pages and every free unmaps them), so
the first write to each page takes a page fault that zeroes it, and on a
virtual machine often a host fault too. For a large broadcast that costs
about as much as moving the bytes: torch gloo and a raw stream write into
buffers the caller already holds, while our results are new arrays (as
JAX's are). So the data plane takes its result buffers from a small pool:
a buffer goes back to the pool when the last array (or view) of it is gone,
and the next call of that size writes into pages already mapped.

Nothing grows: the pool keeps at most `MULTIHOST_RESULT_POOL_MIB` (default
512) of idle buffers, and only buffers of at least `_SMALLEST` bytes
(smaller ones come from malloc's heap, which keeps its pages). Set it to 0
for plain `np.empty`. Over the limit, the largest idle buffer goes first
(of equal ones, the least recently returned): a job whose results do not
all fit keeps the most of them, and one large result (an all-gather of P
large blocks, say) does not push out the buffers of every smaller call.
"""

from __future__ import annotations

import collections
import mmap
import threading
import weakref

import numpy as np

from multihost._src.runtime import settings

# Below this, np.empty: malloc keeps freed memory of this size mapped.
_SMALLEST = 256 << 10
_PAGE = mmap.PAGESIZE


class Pool:
  """Idle result buffers by size (bounded); see the module docstring."""

  def __init__(self, limit: int | None = None):
    self._limit = limit  # bytes; None: read from the environment on first use
    # Reentrant: a buffer can come back (its array's callback) from a
    # garbage collection that runs while this thread holds the lock.
    self.lock = threading.RLock()
    self.idle: collections.OrderedDict[int, mmap.mmap] = (
        collections.OrderedDict())
    self.idle_bytes = 0
    # The buffers lent out, by id of the weak reference to the array lent:
    # its callback gives the memory back once the array is gone (see `take`).
    self.lent: dict[int, tuple[weakref.ref, mmap.mmap]] = {}

  @property
  def limit(self) -> int:
    if self._limit is None:
      self._limit = settings.result_pool_bytes()
    return self._limit

  def take(self, nbytes: int) -> np.ndarray:
    """A writable uint8 array of `nbytes` (contents undefined)."""
    if nbytes < _SMALLEST or nbytes > self.limit:
      return np.empty(nbytes, np.uint8)
    size = -(-nbytes // _PAGE) * _PAGE
    memory = None
    with self.lock:
      for key, idle in self.idle.items():
        if len(idle) == size:
          memory = self.idle.pop(key)
          self.idle_bytes -= size
          break
    if memory is None:
      memory = mmap.mmap(-1, size)
    # The array is the only exporter of `memory`; views of it keep it (not
    # `memory`) as their base, so its weak reference's callback runs once
    # none is left. (A weak reference kept here costs half of a
    # weakref.finalize, on every large result of every call.)
    array = np.frombuffer(memory, np.uint8, count=nbytes)
    ref = weakref.ref(array, self._gone)
    self.lent[id(ref)] = (ref, memory)
    return array

  def _gone(self, ref: weakref.ref) -> None:
    """A lent array is gone: its memory goes back (`_give_back`)."""
    lent = self.lent.pop(id(ref), None)
    if lent is not None:
      self._give_back(lent[1])

  def _give_back(self, memory: mmap.mmap) -> None:
    with self.lock:
      self.idle[id(memory)] = memory
      self.idle_bytes += len(memory)
      while self.idle_bytes > self.limit:
        # max() keeps the first of equal sizes: the least recently returned.
        largest = max(self.idle, key=lambda key: len(self.idle[key]))
        dropped = self.idle.pop(largest)
        self.idle_bytes -= len(dropped)
        if dropped is not memory:
          dropped.close()
        # else: the array being collected still exports `memory`, which
        # is unmapped once that last reference goes.

  def idle_sizes(self) -> list[int]:
    """The idle buffers' sizes, least recently returned first."""
    with self.lock:
      return [len(m) for m in self.idle.values()]


# Memory is the process's, not a runtime's: one pool per process.
POOL = Pool()


def take(nbytes: int) -> np.ndarray:
  """A writable uint8 array of `nbytes` for a result (see `Pool.take`)."""
  return POOL.take(nbytes)
