"""What the bare-JAX test programs share: every process's index, gathered by JAX alone, every local device's part awaited (imported, never run)."""

from __future__ import annotations

import jax
import numpy as np


def process_indices() -> list[int]:
  """Every process's `jax.process_index()`, in process order, by a jitted all-gather over all devices; returns once every local device's part has run.

  Not `jax.experimental.multihost_utils.process_allgather`: with more than
  one device per process it reads one device's result and returns while
  the other local devices' parts may still run (with 2 devices a
  process, the second's part had not run in 175 of 300 such calls read
  that way). A process that then exits at once has been seen to leave
  its peer stuck at exit, in the CPU client's teardown, behind a device
  thread waiting in gloo's connect for the process that left (1 launch
  in about 95 beside a full test run here; 2 of 6 CI runs).
  """
  devices = np.array(jax.devices()).reshape(jax.process_count(),
                                            jax.local_device_count())
  mesh = jax.sharding.Mesh(devices, ('processes', 'local'))
  rows = jax.make_array_from_process_local_data(
      jax.sharding.NamedSharding(mesh, jax.P('processes')),
      np.array([jax.process_index()], np.int32))
  everywhere = jax.sharding.NamedSharding(mesh, jax.P())
  got = jax.jit(lambda x: x, out_shardings=everywhere)(rows)
  got.block_until_ready()  # Every local device's part, not only the first.
  return np.asarray(got.addressable_data(0)).tolist()
