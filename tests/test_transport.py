"""Both data planes for large payloads, at an odd process count."""

from __future__ import annotations

import sys
import textwrap

import pytest

from multihost import env as env_lib
from multihost import launch

_SCRIPT = textwrap.dedent('''
    import numpy as np
    import multihost
    multihost.initialize()
    import jax
    me, count = jax.process_index(), jax.process_count()
    big = np.arange(3 << 18, dtype=np.float32) * (me + 1)  # 3 MiB
    for source in range(count):
      got = multihost.broadcast_one_to_all(big, is_source=me == source)
      np.testing.assert_array_equal(got, big / (me + 1) * (source + 1))
    stacked = multihost.process_allgather({'a': big, 'b': np.int32(me)})
    for p in range(count):
      np.testing.assert_array_equal(stacked['a'][p], big / (me + 1) * (p + 1))
    assert stacked['b'].tolist() == list(range(count))
    sizes = [len(x) for x in multihost.allgather_object(b'z' * (200_000 * (me + 1)))]
    assert sizes == [200_000 * (p + 1) for p in range(count)], sizes
    print('TRANSPORT OK', flush=True)
''')


@pytest.mark.parametrize('transport', ['tcp', 'device'])
def test_large_payloads_over_each_transport(tmp_path, transport):
  script = tmp_path / 'bulk.py'
  script.write_text(_SCRIPT)
  result = launch.launch([sys.executable, str(script)], num_processes=3,
                         devices_per_process=1, timeout=120,
                         env={env_lib.TRANSPORT: transport})
  assert result.ok, result.summary + '\n'.join(result.outputs)
  assert all('TRANSPORT OK' in out for out in result.outputs)


def test_unknown_transport_is_a_clear_error(monkeypatch):
  from multihost import lowlevel
  monkeypatch.setenv(env_lib.TRANSPORT, 'carrier-pigeon')
  with pytest.raises(ValueError, match='use tcp'):
    lowlevel.tcp_transport_enabled()
