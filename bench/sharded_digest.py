r"""Peak memory and time of `multihost.tree_digest` on a 256 MiB array sharded over all processes.

  python -m multihost.launch --num_processes=2 --devices_per_process=1 -- \
      python bench/sharded_digest.py [MiB] [axis names of the PartitionSpec]

e.g. `... bench/sharded_digest.py 256 x` (rows) or `256 None x` (columns).
Prints per process: the digest, the peak RSS increase of one call
(VmHWM after, after resetting it through /proc/self/clear_refs, minus VmRSS
before) and the median of 3 timed calls.
"""
import sys
import time

import jax
import numpy as np

import multihost


def status(field):
  for line in open('/proc/self/status'):
    if line.startswith(field + ':'):
      return int(line.split()[1]) * 1024

multihost.initialize()
mb = int(sys.argv[1]) if len(sys.argv) > 1 else 256
shape = (mb << 20) // 4 // 1024, 1024
mesh = jax.make_mesh((jax.device_count(),), ('x',))
sh = jax.sharding.NamedSharding(mesh, jax.P(*[None if a == 'None' else a for a in sys.argv[2:]]) if len(sys.argv) > 2 else jax.P('x'))
def cb(idx):
  rows = np.arange(shape[0], dtype=np.float32)[idx[0]]
  cols = np.arange(1024, dtype=np.float32)[idx[1]]
  return (rows[:, None] * 3 + cols[None, :])
x = jax.make_array_from_callback(shape, sh, cb)
jax.block_until_ready(x)
multihost.tree_digest({'w': x})  # warm
times = []
for _ in range(3):
  multihost.sync_global_devices('t')
  t0 = time.perf_counter()
  d = multihost.tree_digest({'w': x})
  times.append(time.perf_counter() - t0)
multihost.sync_global_devices('m')
open('/proc/self/clear_refs', 'w').write('5')
before = status('VmRSS')
d = multihost.tree_digest({'w': x})
peak = status('VmHWM') - before
print(f'p{jax.process_index()} digest={d} peak_extra={peak/2**20:.0f}MiB median={sorted(times)[1]*1e3:.0f}ms own_shards={sum(s.data.nbytes for s in x.addressable_shards)/2**20:.0f}MiB', flush=True)
