"""Public collective: write_trace, every process's flight recorder merged into one Chrome trace-event file."""

from __future__ import annotations

import json
import os

from multihost._src.api import gather
from multihost._src.diagnostics import trace_format
from multihost._src.runtime import files
from multihost._src.runtime import runtime
from multihost._src.runtime import settings


def write_trace(path: str | os.PathLike, *,
                timeout: float | None = None) -> str | None:
  """Writes the job's timeline (the last collectives and events of every process) to `path` on process 0.

  Collective: every process must call this, in the same order.

  The file is Chrome trace-event JSON (open it in https://ui.perfetto.dev
  or chrome://tracing): one track per process, one event per collective
  (op, barrier name, call, bytes, wait and move ms), the events recorded
  with `multihost.record_event`, and how late each process arrived. The
  processes' clocks are aligned on the collectives' barrier exits (see
  `multihost._src.diagnostics.trace_format`). `multihost.launch --trace=PATH` writes the
  same at the end of a run without this call, failures included.

  Args:
    path: the file process 0 writes (the others write nothing).
    timeout: seconds to wait for every process.

  Returns:
    The first divergence between the processes' calls in one line (see
    `diagnostics.trace_format.divergence`), or None; the same on every process.

  Raises:
    CollectiveTimeoutError: a process did not arrive in time (named).
    OSError: on process 0, `path` could not be written (its folder is
      missing or not writable); the file is then unchanged (see
      `multihost.files.write_atomic`), and the others return as usual.
  """
  rt = runtime.current()
  attempt = settings.restart_count()
  mine = rt.flight.snapshot(rt.index, attempt=attempt, count=rt.count)
  dumps = gather.allgather_object(mine, timeout=timeout)
  if rt.index == 0:
    trace = trace_format.build(dumps, num_processes=rt.count)
    files.write_atomic(path, json.dumps(trace))
  return trace_format.divergence(dumps, rt.count)
