"""How a broadcast through the source's stage cuts its payload into pieces (`transport.tcp.shared._pieces`): what every process must compute alike."""

from __future__ import annotations

import pytest

from multihost._src.transport.tcp import shared
from multihost._src.transport.tcp import stage

MiB = 1 << 20


@pytest.mark.parametrize('count', [2, 3, 8])
@pytest.mark.parametrize('length', [shared.SHARED_FROM, 300_001, MiB,
                                    8 * MiB + 4096, 64 * MiB + 5])
def test_the_pieces_tile_the_payload_and_each_fits_a_slot(length, count):
  pieces = shared._pieces(length, count)
  assert pieces[0][0] == 0 and pieces[-1][1] == length
  assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
  sizes = [stop - start for start, stop in pieces]
  assert all(0 < s <= stage.SLOT_BYTES for s in sizes), sizes
  # Every piece but the last is the same size, at least MIN_PIECE.
  assert len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0]
  assert sizes[0] >= min(length, shared.MIN_PIECE)


def test_between_two_processes_a_mid_sized_payload_goes_in_overlapping_pieces():
  # 2 processes: at least PIECES pieces once each is MIN_PIECE or more, so
  # the receiver's copy of one overlaps the source's copy of the next.
  assert len(shared._pieces(MiB, 2)) == shared.PIECES
  assert len(shared._pieces(8 * MiB, 2)) == shared.PIECES
  assert len(shared._pieces(shared.SHARED_FROM, 2)) == 2  # 2 x MIN_PIECE
  # Among more, a piece is as large as a slot: each costs a frame per receiver.
  assert len(shared._pieces(MiB, 3)) == 1
  assert len(shared._pieces(8 * MiB, 3)) == 2
  # Large payloads: slot-sized pieces at any count.
  assert shared._pieces(64 * MiB, 2) == shared._pieces(64 * MiB, 3)


@pytest.mark.parametrize('count', [2, 3, 8])
@pytest.mark.parametrize('length', [shared.SHARED_FROM, MiB, 3 * MiB + 1,
                                    stage.STAGE_BYTES])
def test_a_payload_that_fits_the_stage_lies_whole_and_nothing_is_released(
    length, count):
  # The source then never waits for a receiver: each piece has its own
  # place, free again only once the next call agreed.
  pieces = shared._pieces(length, count)
  places = [shared._place(k, start, length)
            for k, (start, _) in enumerate(pieces)]
  assert places == [start for start, _ in pieces]
  assert not any(shared._released(k, len(pieces), length)
                 for k in range(len(pieces)))


@pytest.mark.parametrize('count', [2, 3])
@pytest.mark.parametrize('length', [stage.STAGE_BYTES + 1, 9 * MiB + 12,
                                    64 * MiB + 5])
def test_a_larger_payload_takes_the_slots_in_turn_each_released_before_reuse(
    length, count):
  pieces = shared._pieces(length, count)
  places = [shared._place(k, start, length)
            for k, (start, _) in enumerate(pieces)]
  assert places == [(k % 2) * stage.SLOT_BYTES for k in range(len(pieces))]
  assert all(place + stop - start <= stage.STAGE_BYTES
             for place, (start, stop) in zip(places, pieces))
  # A piece is released exactly when a later piece takes its slot.
  released = [shared._released(k, len(pieces), length)
              for k in range(len(pieces))]
  assert released == [k + 2 < len(pieces) for k in range(len(pieces))]
