"""`python -m multihost.launch.quiet`: copies standard input to standard output without gloo's connection lines.

For output that a program other than the launcher reads: pipe `srun`'s or
`mpirun`'s stdout through it, as docs/restart.sbatch does::

  mpirun -np 2 python bin/train.py --checkpoint_dir=DIR | python -m multihost.launch.quiet

It drops the lines of JAX's CPU collectives (gloo) that say
`[Gloo] Rank N is connected to M peer ranks. ...`, interleaved ones too,
and passes every other byte unchanged and in order (a partial line that
could still become gloo's waits at most 50 ms for the rest). It ends at
the end of its input, ignoring SIGINT, SIGTERM and SIGHUP so that the last
lines after a Ctrl-C or a scheduler's signal pass; when its stdout is a
closed pipe (`| head`) it ends at once, so the writer gets EPIPE as it would
without it. A failed write (a full disk) loses that write's bytes, is said
once on stderr, and later lines are written again once there is space.
`MULTIHOST_QUIET_GLOO=0` passes everything. It does not import JAX.
"""

from __future__ import annotations

from multihost._src.diagnostics import gloo_lines

if __name__ == '__main__':
  gloo_lines.main('python -m multihost.launch.quiet')
