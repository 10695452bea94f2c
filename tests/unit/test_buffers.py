"""The data plane's result pool: memory is used again only once no array views it, and the pool stays bounded."""

from __future__ import annotations

import numpy as np
import pytest

from multihost import env as env_lib
from multihost._src.transport import buffers

MIB = 1 << 20

# A finalizer that raises (a buffer closed while still exported) fails the test.
pytestmark = pytest.mark.filterwarnings(
    "error::pytest.PytestUnraisableExceptionWarning")


def _address(array: np.ndarray) -> int:
  return array.__array_interface__['data'][0]


def test_memory_is_used_again_only_after_the_last_view_is_gone():
  pool = buffers.Pool(16 * MIB)
  first = pool.take(MIB)
  first[:] = 7
  where = _address(first)
  # Views of every kind keep the memory: a slice, a dtype view, a memoryview
  # and an array made from that memoryview (as the collectives' leaves are).
  kept = np.frombuffer(memoryview(first[8:].view(np.float64)), np.float64)
  del first
  assert pool.idle_sizes() == []
  second = pool.take(MIB)
  assert _address(second) != where  # still in use: not handed out again
  second[:] = 1
  assert np.all(kept.view(np.uint8) == 7)
  del kept
  assert pool.idle_sizes() == [MIB]
  third = pool.take(MIB)
  assert _address(third) == where and pool.idle_sizes() == []
  assert third.flags.writeable and third.dtype == np.uint8 and (
      third.shape == (MIB,))
  # Nothing of a result stays behind once it is gone (calls do not grow it).
  assert len(pool.lent) == 2
  del second, third
  assert not pool.lent and pool.idle_sizes() == [MIB, MIB]


def test_the_pool_keeps_at_most_its_limit_dropping_the_largest_first():
  pool = buffers.Pool(4 * MIB)
  arrays = [pool.take(n * MIB) for n in (1, 1, 2, 1)]
  del arrays[0]  # 1 MiB idle
  del arrays[0]  # 2 MiB idle
  del arrays[0]  # 4 MiB idle
  assert pool.idle_sizes() == [MIB, MIB, 2 * MIB]
  del arrays[0]  # 5 MiB would be idle: the largest (2 MiB) goes
  assert pool.idle_sizes() == [MIB, MIB, MIB]
  assert pool.idle_bytes <= pool.limit
  # A result larger than every idle buffer is the one dropped.
  big = pool.take(2 * MIB)
  del big
  assert pool.idle_sizes() == [MIB, MIB, MIB]
  # A size with no idle buffer of its own gets new memory; those stay idle.
  odd = pool.take(MIB + 1)
  assert len(odd) == MIB + 1 and pool.idle_sizes() == [MIB, MIB, MIB]


def test_of_equal_sizes_the_least_recently_returned_goes():
  pool = buffers.Pool(3 * MIB)
  arrays = [pool.take(MIB) for _ in range(4)]
  addresses = [_address(a) for a in arrays]
  for _ in range(4):  # returned in order 0, 1, 2, 3: buffer 0 goes
    del arrays[0]
  again = [pool.take(MIB) for _ in range(3)]
  assert sorted(_address(a) for a in again) == sorted(addresses[1:])


def test_one_large_result_does_not_push_out_the_smaller_calls_buffers():
  # Broadcasts of 1 and 12 MiB beside an all-gather whose result is as
  # large as the whole pool (as 4 x 64 MiB at P=4 in a 256 MiB pool): the
  # working set (61 MiB) is over the limit, and the large result is the one
  # that is not kept (oldest first kept only it, and every call faulted).
  pool = buffers.Pool(48 * MIB)
  for _ in range(3):
    for n in (1, 12, 48):
      result = pool.take(n * MIB)
      del result
  assert sorted(pool.idle_sizes()) == [MIB, 12 * MIB]


def test_small_or_too_large_or_disabled_results_are_plain_arrays(monkeypatch):
  pool = buffers.Pool(4 * MIB)
  for n in (10, (256 << 10) - 1, 5 * MIB):
    array = pool.take(n)
    assert array.flags.owndata and len(array) == n
  monkeypatch.setenv(env_lib.RESULT_POOL_MIB, '0')
  off = buffers.Pool()
  assert off.limit == 0 and off.take(MIB).flags.owndata
  monkeypatch.setenv(env_lib.RESULT_POOL_MIB, 'lots')
  with pytest.raises(ValueError, match='MULTIHOST_RESULT_POOL_MIB'):
    assert buffers.Pool().limit
