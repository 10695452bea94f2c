"""The benchmark of `bin/bench.py`: multihost against jax.experimental.multihost_utils.

Not an installed package: `bin/bench.py` puts the repository root on
`sys.path` and imports it. Modules, each importing only those above it:

  harness.py         timing: barriers, interleaved calls, medians of the slowest
                     process, first calls, peak memory; the Row and Case types
  report.py          the markdown tables, the run's header and the JSON Lines
  collectives.py     the comparison cases (inputs, meshes, ours vs JAX's)
  reference.py       reference rows: raw barrier, plain jitted collectives,
                     loopback TCP, torch.distributed
  recovery_suite.py  recovery.Checkpoints against plain Orbax
  record_cost.py     (a script) the per-call cost of a collective's trace
                     record and metrics, measured on multihost's internals
"""
