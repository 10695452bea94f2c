"""Public collective: exchange, point to point (each process sends what it names to whom it names, and each byte goes only there).

The call agrees on the pattern first: every process publishes, in the
call's agreement, whom it sends to (with the sizes of what it sends and
a seal of each pickle) and, if it says, whom it expects from. Every
process checks every pair from the same records, so a sender its
destination does not expect, or a source that sends nothing to a process
that expects it, raises the same `ConsistencyError` on every process
before any byte moves. Then each payload travels over the TCP link
between its two processes only (`transport.tcp.pairs`): no byte passes
through, or reaches, a third process.

A payload is pickled with protocol 5: its NumPy arrays (jax.Arrays as
NumPy arrays) stay out of band,
sent from their own memory and received into one buffer per source, of
which the arrays it returns are views (no extra copy either side). Only
the pickle itself (the structure, small values, bytes objects) counts
against the object limit ($MULTIHOST_MAX_OBJECT_BYTES) and is sealed
with the job secret and checked before it is unpickled.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping
import io
import operator
import pickle
import struct
from typing import Any

import jax
import numpy as np

from multihost._src.api import objects
from multihost._src.control import agree
from multihost._src.diagnostics import metrics
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import process as _process
from multihost._src.transport import choice

_OP = 'exchange'
# A process's record: whether it names its sources, how many destinations
# and sources; per destination: the process, the pickle's length, how many
# out-of-band buffers, the seal's length, then the buffers' lengths and
# the seal; then the sources.
_HEAD = struct.Struct('<BII')
_SEND = struct.Struct('<IQIH')
_LEN = struct.Struct('<Q')
_PROC = struct.Struct('<I')
_MOST_NAMED = 4  # pairs named in a mismatch's message


class _Pattern:
  """One process's part of the pattern, as its record says."""

  __slots__ = ('sends', 'recv_from')

  def __init__(self, sends: dict[int, tuple[int, list[int], bytes]],
               recv_from: set[int] | None):
    self.sends = sends  # destination -> (pickle length, buffers, seal)
    self.recv_from = recv_from


@metrics.recorded(_OP)
def exchange(sends: Mapping[int, Any], *,
             recv_from: Iterable[int] | None = None,
             timeout: float | None = None) -> dict[int, Any]:
  """Sends `sends[d]` to process `d` alone; returns what each process sent here, by sender.

  Collective: every process must call this, in the same order (one that
  sends and receives nothing passes `{}`). Each payload travels only to its
  destination, over the TCP link between the two processes (whatever
  $MULTIHOST_TRANSPORT says): a process receives exactly what was sent to
  it, nothing else passes through it.

  Any picklable value: NumPy arrays in it travel out of band, from their
  own memory, and come back as views of one receive buffer per sender (no
  extra copy either side; the object limit, $MULTIHOST_MAX_OBJECT_BYTES,
  does not apply to them); so do fully addressable jax.Arrays, which come
  back as NumPy arrays (a strided array is made contiguous first). The
  rest is pickled (bytes objects too: pass large ones as
  `np.frombuffer(data, np.uint8)`), sealed with the job secret and
  checked before it is unpickled, up to the object limit.
  A value sent to this process itself is returned as is.

  The processes agree on the pattern before any byte moves: with
  `recv_from`, a process says whom it expects from, and a sender it does
  not expect, or a source in `recv_from` that sends it nothing, raises
  `ConsistencyError` on every process, naming the pairs. Without it, a
  process takes whatever is sent to it.

  Args:
    sends: destination process index -> the value to send there.
    recv_from: the processes this one expects a value from (default: any).
    timeout: seconds to wait for every process, for the agreement and
      again for the transfer.

  Returns:
    sender process index -> the value it sent here (every sender in
    `recv_from`, when given).

  Raises:
    ValueError: a destination or source is not a process index of the job.
    ConsistencyError: the processes' senders and receivers do not match.
    MultihostError: a pickle over the object limit (on every process).
    CollectiveTimeoutError: a process did not arrive, send or read in time
      (named).
    ProcessFailureError: a peer died during the call.
  """
  timeout = _process.resolve_timeout(timeout)
  me, count = _process.process_index(), _process.process_count()
  dests = _indices(sends, count, 'a destination in `sends`')
  expected = (None if recv_from is None else
              set(_indices(recv_from, count, 'a process in `recv_from`')))
  outgoing: dict[int, tuple[bytes, list]] = {}
  for dest in dests:
    if dest != me:
      outgoing[dest] = _pickled(sends[dest])
  seals = {d: objects.seal(_OP, head, timeout)
           for d, (head, _) in outgoing.items()}
  mine = _Pattern({d: (0, [], b'') if d == me else
                   (len(outgoing[d][0]), [v.nbytes for v in outgoing[d][1]],
                    seals[d]) for d in dests}, expected)
  if count == 1:
    patterns = [mine]
  else:
    records, headers = agree.agree_and_gather(
        agree.Header(_OP), timeout=timeout, publish=_record(mine))
    if headers is not None:  # (a difference `agree` names raised there)
      raise errors.ConsistencyError(
          f'{failures.prefix()} {_OP}: the processes\' calls differ: '
          f'{failures.groups([h.agreement().hex() for h in headers])}. '
          'Every process must run the same version of multihost.')
    patterns = [_read_record(p, r, count)
                for p, r in enumerate(agree.shared(records, _OP))]
  check_pattern(patterns)
  incoming = {p: pat.sends[me] for p, pat in enumerate(patterns)
              if p != me and me in pat.sends}
  for p, pattern in enumerate(patterns):  # (alike on every process)
    for head_len, _, _ in pattern.sends.values():
      objects.check_size(_OP, p, head_len)
  out: dict[int, Any] = {}
  if me in mine.sends:
    out[me] = sends[me]
  if count == 1:
    return out
  # (Also where nothing moves here: every process numbers the transfer.)
  received = choice.exchange(
      {d: [head, *views] for d, (head, views) in outgoing.items()},
      {p: head_len + sum(lens) for p, (head_len, lens, _) in incoming.items()},
      op=_OP, timeout=timeout)
  for p in sorted(incoming):
    head_len, lens, seal = incoming[p]
    data = received.pop(p).data
    views, at = [], head_len
    for n in lens:
      views.append(data[at:at + n])
      at += n
    out[p] = objects.loads(_OP, p, data[:head_len], seal, timeout,
                           buffers=views)
  return dict(sorted(out.items()))


def _indices(values: Iterable[Any], count: int, what: str) -> list[int]:
  """`values` as process indices; raises ValueError naming one that is not."""
  out = []
  for value in values:
    try:
      index = operator.index(value)
    except TypeError:
      index = -1
    if not 0 <= index < count:
      raise ValueError(
          f'{failures.prefix()} {_OP}: {what} is {value!r}, not a process '
          f'index of this job (0 to {count - 1}).')
    out.append(index)
  return sorted(set(out))


class _Pickler(pickle.Pickler):
  """Protocol 5, with more arrays out of band: a jax.Array as its NumPy value, a strided array as a contiguous copy."""

  def reducer_override(self, obj):
    if isinstance(obj, jax.Array):
      return np.asarray(obj).__reduce_ex__(5)
    if (isinstance(obj, np.ndarray) and obj.dtype.hasobject is False
        and not (obj.flags.c_contiguous or obj.flags.f_contiguous)):
      return np.ascontiguousarray(obj).__reduce_ex__(5)
    return NotImplemented


def _pickled(value: Any) -> tuple[bytes, list[memoryview]]:
  """(the pickle, its out-of-band buffers as flat byte views)."""
  buffers: list[pickle.PickleBuffer] = []
  out = io.BytesIO()
  _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(value)
  return out.getvalue(), [b.raw() for b in buffers]


def check_pattern(patterns: list[_Pattern]) -> None:
  """Raises ConsistencyError (the same on every process) unless every sender is expected by its destination and every expected source sends.

  Pure: every process runs it on the same records.
  """
  problems = []
  for p, pattern in enumerate(patterns):
    for d in sorted(pattern.sends):
      wanted = patterns[d].recv_from
      if wanted is not None and p not in wanted:
        problems.append(
            f'process {p} sends to process {d}, which does not expect a '
            f'value from it (its recv_from: {sorted(wanted)})')
  for q, pattern in enumerate(patterns):
    for s in sorted(pattern.recv_from or ()):
      if q not in patterns[s].sends:
        problems.append(
            f'process {q} expects a value from process {s}, which sends it '
            f'none (it sends to {sorted(patterns[s].sends) or "no process"})')
  if not problems:
    return
  more = len(problems) - _MOST_NAMED
  raise errors.ConsistencyError(
      f'{failures.prefix()} {_OP}: the processes disagree on who sends to '
      f'whom: {"; ".join(problems[:_MOST_NAMED])}'
      f'{f" (and {more} more)" if more > 0 else ""}. Every process a '
      'process sends to must list it in `recv_from` (or pass none), and '
      'every process in `recv_from` must send to it.')


def _record(pattern: _Pattern) -> bytes:
  """What a process publishes of its pattern in the call's agreement."""
  sources = sorted(pattern.recv_from or ())
  out = [_HEAD.pack(pattern.recv_from is not None, len(pattern.sends),
                    len(sources))]
  for dest, (head_len, lens, seal) in sorted(pattern.sends.items()):
    out.append(_SEND.pack(dest, head_len, len(lens), len(seal)))
    out.extend(_LEN.pack(n) for n in lens)
    out.append(seal)
  out.extend(_PROC.pack(s) for s in sources)
  return b''.join(out)


def _read_record(process: int, value, count: int) -> _Pattern:
  """`process`'s pattern from its record; raises MultihostError if it holds none."""
  try:
    named, n_sends, n_sources = _HEAD.unpack_from(value)
    at = _HEAD.size
    sends = {}
    for _ in range(n_sends):
      dest, head_len, n_lens, n_seal = _SEND.unpack_from(value, at)
      at += _SEND.size
      lens = [_LEN.unpack_from(value, at + k * _LEN.size)[0]
              for k in range(n_lens)]
      at += n_lens * _LEN.size
      seal = bytes(value[at:at + n_seal])
      at += n_seal
      sends[dest] = (head_len, lens, seal)
    sources = set()
    for _ in range(n_sources):
      sources.add(_PROC.unpack_from(value, at)[0])
      at += _PROC.size
    if at != len(value) or any(p >= count for p in (*sends, *sources)):
      raise struct.error('trailing bytes or a process out of range')
  except struct.error:
    raise errors.MultihostError(
        f'{failures.prefix()} {_OP}: process {process}\'s record of its '
        f'pattern ({len(value)} bytes) does not hold whom it sends to and '
        'whom it expects from; every process must run the same version of '
        'multihost.') from None
  return _Pattern(sends, sources if named else None)
