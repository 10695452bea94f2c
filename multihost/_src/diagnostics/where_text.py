"""Diagnostics: where-reports rendered as text (one sentence per process in errors, one line per stall, the full report of `multihost.where()`).

Pure: it renders the reports `diagnostics.where` collects (JSON-able dicts, None for a
process that did not answer) and asks nothing.
"""

from __future__ import annotations

from multihost._src.liveness import step_report
from multihost._src.runtime import failures

_prefix = failures.prefix


def _frames(report: dict, limit: int) -> str:
  """The main thread's innermost `limit` frames, innermost first: 'f (file:line) <- g (file:line)'.

  When the program's own innermost frame (its main module's, `program`) is
  not among them, it ends the list after an ellipsis: 'f (...) <- ... <-
  main (train.py:9)'.
  """
  main = next((t for t in report['threads'] if t['main']), None)
  if main is None or not main['frames']:
    return 'main thread: no Python frames'
  frames = main['frames'][::-1][:limit]
  own = main.get('program')
  text = ' <- '.join(f'{func} ({path}:{line})' for path, line, func in frames)
  if own is not None and own not in frames:
    path, line, func = own
    text += f' <- ... <- {func} ({path}:{line})'
  return 'main thread in ' + text


def _collectives(report: dict) -> str:
  """Where the process is in its training steps (if it marks them), then its collectives."""
  step = report.get('step')
  parts = [] if not step else [step_report.position_text(step)]
  last = report.get('last')
  parts.append('last completed collective: ' + (
      'none' if last is None else
      f'{last["label"]}, finished {last["ago"]:.1f} s ago'))
  raised = report.get('raised')
  if raised is not None:
    parts.append(f'then {raised["label"]} raised {raised["error"]} here '
                 f'{raised["ago"]:.1f} s ago')
  now_in = report.get('now_in')
  if now_in is not None:
    parts.append(f'now waiting in {now_in["label"]} for '
                 f'{now_in["for"]:.1f} s')
  else:
    parts.append('not in a collective')
  return '; '.join(parts)


def whereabouts(reports: dict[int, dict | None], timeout: float) -> str:
  """One sentence per process of `reports`: its main thread's innermost frames and its last collective."""
  parts = []
  for p, report in sorted(reports.items()):
    if report is None:
      parts.append(f'process {p}: not answering within {timeout:g} s '
                   '(likely dead, or wedged in C++)')
    else:
      parts.append(f'process {p}: {_frames(report, 4)}; '
                   f'{_collectives(report)}')
  return 'Where they are: ' + '. '.join(parts) + '.'


def main_thread(report: dict) -> str:
  """This process's main thread and collectives on one line (for the line it logs as it leaves)."""
  return f'{_frames(report, 6)}; {_collectives(report)}.'


def stall_line(op: str, *, waited: float, reports: dict[int, dict | None],
               timeout: float, me: int | None = None) -> str:
  """The one line a collective still waiting after the stall threshold logs."""
  if not reports:
    return (f'{_prefix(me)} {op}: still waiting after {waited:g} s (every '
            'process has arrived; a device transfer or the service is '
            'slow).')
  return (f'{_prefix(me)} {op}: still waiting after {waited:g} s for '
          f'process(es) {sorted(reports)}. {whereabouts(reports, timeout)}')


def where_text(reports: dict[int, dict | None], *, timeout: float,
               title: str = '') -> str:
  """The full report of `reports`: per process, its collectives and every thread's innermost frames."""
  lines = []
  for p, report in sorted(reports.items()):
    head = f'{_prefix(p)} where{" (" + title + ")" if title else ""}:'
    if report is None:
      lines.append(f'{head} not answering within {timeout:g} s (likely dead, '
                   'or wedged in C++)')
      continue
    lines.append(f'{head} pid {report["pid"]} on {report["host"]}; '
                 f'{_collectives(report)}')
    for thread in report['threads']:
      lines.append(f'{_prefix(p)}   thread {thread["name"]!r}'
                   f'{" (main)" if thread["main"] else ""}, innermost first:')
      for path, line, func in thread['frames'][::-1]:
        lines.append(f'{_prefix(p)}     {path}:{line} {func}')
  return '\n'.join(lines)
