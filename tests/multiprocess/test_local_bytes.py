"""The local tier moves only what each host needs: at 4 processes, each its own host, the bytes a local save moves per process (loopback bytes in a private network namespace, a run with the local tier minus the same run without: `bench/local_bytes.py`) are at most 1.25 x the blocks it sends its peer."""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

import _helpers
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench import local_bytes  # noqa: E402  pylint: disable=g-import-not-at-top


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which('unshare')
                    or not shutil.which('ip'),
                    reason='needs root, unshare and ip (a private network '
                    'namespace counts the bytes)')
def test_a_local_save_moves_each_process_s_blocks_once(monkeypatch):
  for name, value in _helpers.quick_compile_env().items():
    monkeypatch.setenv(name, value)  # bench/local_bytes.py passes it on.
  # Leaves of 2 MiB: the consistency check's digests of leaves up to
  # 1 MiB gather them whole (`multihost.tree_digest`), which would be
  # counted here too.
  row = local_bytes.measure(4, width=1 << 19, steps=10, every=5,
                            timeout=300)
  assert row['local_saves'] == 2, row
  assert row['blocks_sent_to_peer_S'] == (1 << 19) * 4 * 2 / 4, row
  assert row['ratio_to_S'] <= 1.25, row
