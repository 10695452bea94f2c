"""multihost.exchange's pattern: its record's round trip and the check every process runs on the same records."""

from __future__ import annotations

import pytest

import multihost
from multihost._src.api import exchange as ex


def _pattern(sends, recv_from=None):
  return ex._Pattern({d: (10 * d + 1, [d, 2 * d], b's' * d) for d in sends},
                     None if recv_from is None else set(recv_from))


def test_a_record_reads_back_as_written():
  for pattern in (_pattern([]), _pattern([0, 2, 3], [1]),
                  _pattern([1], [])):
    got = ex._read_record(0, ex._record(pattern), count=4)
    assert got.sends == pattern.sends and got.recv_from == pattern.recv_from


@pytest.mark.parametrize('cut', [1, 5, -1])
def test_a_damaged_record_is_named(cut):
  record = ex._record(_pattern([1, 2], [3]))
  with pytest.raises(multihost.MultihostError, match="process 3's record"):
    ex._read_record(3, record[:cut] + (b'x' if cut == -1 else b''), count=4)
  with pytest.raises(multihost.MultihostError, match='record'):
    ex._read_record(3, record, count=2)  # (names process 2 and 3)


def test_matching_patterns_pass():
  ex.check_pattern([_pattern([1], [2]), _pattern([2], [0]),
                    _pattern([0], None)])
  ex.check_pattern([_pattern([]), _pattern([])])


def test_an_unexpected_sender_and_a_silent_source_are_named():
  with pytest.raises(multihost.ConsistencyError) as e:
    ex.check_pattern([_pattern([1]), _pattern([], [2]), _pattern([])])
  text = str(e.value)
  assert 'process 0 sends to process 1, which does not expect' in text
  assert 'process 1 expects a value from process 2, which sends it none' in (
      text)


def test_many_problems_are_counted_not_all_listed():
  patterns = [_pattern([p for p in range(8) if p != q], []) for q in range(8)]
  with pytest.raises(multihost.ConsistencyError, match=r'and 52 more'):
    ex.check_pattern(patterns)


def test_a_destination_that_is_no_process_is_refused():
  with pytest.raises(ValueError, match='not a process index'):
    ex._indices([0, 5], 4, 'a destination')
  with pytest.raises(ValueError, match='not a process index'):
    ex._indices(['1'], 4, 'a destination')
