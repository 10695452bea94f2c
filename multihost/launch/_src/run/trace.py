"""`--trace=PATH`: the controllers' flight-recorder dumps merged into one timeline, and the summary's divergence line."""

from __future__ import annotations

import collections.abc
import dataclasses
import glob
import json
import os
import shutil
from typing import Any

from multihost._src.diagnostics import trace_format
from multihost._src.runtime import files  # JAX-free (tests/unit/test_init.py).
from multihost.launch._src.policy import restarts as _restarts
from multihost.launch._src.report import observed as _observed
from multihost.launch._src.report import report as _report


class TraceWriteError(Exception):
  """The merged trace file could not be written; the run itself is unaffected.

  Not an OSError, so that it is never taken for the command failing to
  start. `str()` is the summary's line: the path, the error, where the
  controllers' dumps were kept and what to do.

  Attributes:
    path: the trace file.
    folder: the folder that holds the controllers' dumps, kept; None when
      there were none (nothing to keep).
    error: the OSError writing `path` raised.
    divergence: the last attempt's divergence line (found without the
      file), or None.
  """

  def __init__(self, path: str, folder: str | None, error: OSError,
               divergence: str | None):
    self.path = path
    self.folder = folder
    self.error = error
    self.divergence = divergence
    if folder is None:
      kept = ('No controller left a flight-recorder dump (none initialized '
              'multihost), so nothing was kept')
    else:
      kept = ("The controllers' flight-recorder dumps are kept in "
              f'{folder} (process-N.attempt-K.json); remove it when done')
    super().__init__(
        f'trace: could not write the trace file {path} '
        f'({type(error).__name__}: {error.strerror or error}); the run\'s '
        f'exit status and summary above are its own. {kept}. Give --trace '
        'a path in a folder that exists and this user can write.')


def read_dumps(folder: str) -> list[dict[str, Any]]:
  """The dumps the controllers left in `folder` (unreadable ones skipped: their process is marked not dumped)."""
  dumps = []
  for path in sorted(glob.glob(os.path.join(folder, 'process-*.json'))):
    try:
      with open(path) as f:
        dumps.append(json.load(f))
    except (OSError, ValueError):
      continue
  return dumps


def _last_line(output: str) -> str:
  lines = [line for line in output.splitlines() if line.strip()]
  return lines[-1][:200] if lines else ''


def failures_and_attempts(result: _report.LaunchResult, *, run_wall0: float,
                          starts: collections.abc.Sequence[float]):
  """The trace's failure marks and attempt spans from the run's result (wall-clock times)."""
  failures: dict[int, dict[str, Any]] = {}
  attempts = []
  for k, attempt in enumerate(result.attempts or (result,)):
    begin = run_wall0 + (starts[k] if k < len(starts) else 0.0)
    ends = [t for t in attempt.end_times if t is not None]
    attempts.append({'start': begin, 'end': begin + max(ends, default=0.0),
                     'cause': _restarts.attempt_cause(attempt),
                     # Stopped at once to restart: no dump of theirs.
                     'stopped': sorted(attempt.stopped)})
    for p, rc in enumerate(attempt.returncodes):
      if rc in (0, None) and p != attempt.first_failure:
        continue
      how = _observed.describe(rc)
      if p in attempt.stopped:
        how += ', stopped by the launcher'
      end = attempt.end_times[p]
      # A later attempt's mark replaces an earlier one's: the track is the
      # process's, the attempt is in the mark.
      failures[p] = {'stopped': None if end is None else begin + end,
                     'how': how, 'attempt': k,
                     'last_line': _last_line(attempt.outputs[p])
                     if p < len(attempt.outputs) else ''}
  return failures, attempts


def killed_lines(result: _report.LaunchResult,
                 dumps: collections.abc.Sequence[dict[str, Any]]) -> list[str]:
  """Per process killed by a signal it was not sent by the launcher, one line: what the others' records show of it (its last completed call, the call it never arrived at, who waited for it).

  Such a process left no dump of its own; the merged timeline still tells
  where it stopped. Nothing for a process no other process's dump tells of.
  """
  attempts = result.attempts or (result,)
  lines = []
  for k, attempt in enumerate(attempts):
    ds = [d for d in dumps if d.get('attempt', 0) == k]
    for p, rc in enumerate(attempt.returncodes):
      if rc is None or rc >= 0 or p in attempt.stopped:
        continue
      seen = trace_format.last_seen(ds, p)
      if seen is None:
        continue
      waited = trace_format.waited_for(ds, p)
      at = f' in attempt {k}' if len(attempts) > 1 else ''
      lines.append(f'trace: process {p} ({_observed.describe(rc)}){at}, as the '
                   f'others\' records show: {seen}' +
                   (f', where {waited}' if waited else '') + '.')
  return lines


def write(path: str, folder: str, result: _report.LaunchResult, *,
          num_processes: int, run_wall0: float,
          starts: collections.abc.Sequence[float]) -> str | None:
  """Merges the dumps in `folder` into the trace file `path`; returns the summary's lines on it (the last attempt's divergence, then `killed_lines`), or None.

  The file is written atomically and never through a link
  (`files.write_atomic`).

  Raises:
    TraceWriteError: `path` could not be written (`folder` is left as it
      is, for the caller to keep when it holds dumps).
  """
  dumps = read_dumps(folder)
  failures, attempts = failures_and_attempts(result, run_wall0=run_wall0,
                                             starts=starts)
  trace = trace_format.build(dumps, num_processes=num_processes,
                              failures=failures, attempts=attempts)
  last = len(attempts) - 1
  line = trace_format.divergence(
      [d for d in dumps if d.get('attempt', 0) == last], num_processes)
  killed = killed_lines(result, dumps)
  if killed:
    line = '\n'.join(([line] if line else []) + killed)
  try:
    files.write_atomic(path, json.dumps(trace))
  except OSError as e:
    raise TraceWriteError(path, folder if dumps else None, e, line) from e
  return line


def noted(result: _report.LaunchResult, path: str, folder: str, *,
          num_processes: int, run_wall0: float,
          starts: collections.abc.Sequence[float]) -> _report.LaunchResult:
  """`result` with the trace's line(s) at the end of its summary, once `write` merged the dumps in `folder` into `path` (or said why it could not); `folder` is removed unless it holds the only copy of the dumps."""
  keep = False
  try:
    try:
      line = write(path, folder, result, num_processes=num_processes,
                   run_wall0=run_wall0, starts=starts)
    except TraceWriteError as e:
      keep = e.folder is not None  # The dumps: all left of the timeline.
      note = str(e) + (f'\n{e.divergence}' if e.divergence else '')
    else:
      note = f'trace: {path}' + (f'; {line}' if line else '')
    return dataclasses.replace(result, summary=f'{result.summary}\n{note}')
  finally:
    if not keep:
      shutil.rmtree(folder, ignore_errors=True)
