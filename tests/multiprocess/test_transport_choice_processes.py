"""On CPU, small and large payloads travel over TCP between real controllers."""

from __future__ import annotations

from multihost import launch
from tests._helpers import program


def test_on_cpu_small_and_large_payloads_travel_over_tcp():
  result = launch.launch(program('transport_choice'), num_processes=2,
                         devices_per_process=1, timeout=60)
  assert result.ok, result.summary + '\n' + result.outputs[0][-3000:]
  for out in result.outputs:
    for n in (8, 2 << 20):
      assert f"broadcast {n}: tcp tcp=['broadcast'] ok=True" in out, out
      assert f"allgather {n}: tcp tcp=['allgather'] ok=True" in out, out
    assert 'tree ok=True' in out, out
