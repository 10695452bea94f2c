"""The TCP transport's settings and stripes, in one process (the real transfers are in tests/multiprocess/test_transport_processes.py)."""

from __future__ import annotations

import pytest

from multihost import env as env_lib


def test_a_bad_lane_count_is_a_clear_error(monkeypatch):
  from multihost._src.runtime import settings
  for bad, match in (('0', 'positive number'), ('9', 'more than 8'),
                     ('two', 'positive number')):
    monkeypatch.setenv(env_lib.TCP_LANES, bad)
    with pytest.raises(ValueError, match=match):
      settings.tcp_lanes()
  monkeypatch.setenv(env_lib.TCP_LANES, '')
  assert settings.tcp_lanes() == 2


def test_stripes_cover_the_payload_once():
  from multihost._src.transport.tcp import payload
  assert payload.stripes(payload.STRIPE_BYTES - 1, 2) == [
      (0, payload.STRIPE_BYTES - 1)]
  assert payload.stripes(10 << 20, 1) == [(0, 10 << 20)]
  for length in (payload.STRIPE_BYTES, (5 << 20) + 3, 64 << 20):
    for lanes in range(2, 9):
      got = payload.stripes(length, lanes)
      assert 1 < len(got) <= lanes, (length, lanes, got)
      assert got[0][0] == 0 and got[-1][1] == length
      assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
      assert all(a % 4096 == 0 for a, _ in got)


def test_unknown_transport_is_a_clear_error(monkeypatch):
  from multihost import lowlevel
  monkeypatch.setenv(env_lib.TRANSPORT, 'carrier-pigeon')
  with pytest.raises(ValueError, match='use tcp'):
    lowlevel.tcp_transport_enabled()


