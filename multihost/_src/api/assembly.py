"""The composition root: builds each new Runtime's parts, typed, when the runtime is made.

The runtime (`runtime.runtime`) sits at the bottom of the packages and
cannot import the parts' classes, which sit above it; this module, at the
top, registers the one function that builds them (`assemble`), and every
public function's module imports it (through `multihost._src.api`). A part
gets what it needs from its constructor: nothing fills a part in later or
rewires another part's methods.
"""

from __future__ import annotations

from multihost._src.api import live_devices
from multihost._src.diagnostics import stalls
from multihost._src.diagnostics import where
from multihost._src.diagnostics import where_text
from multihost._src.liveness import step_deadline
from multihost._src.liveness import watchdog
from multihost._src.runtime import runtime


def assemble(rt: runtime.Runtime) -> None:
  """Builds `rt`'s parts: the watchdog, the where-responder, the stall reports, the live blocks and the step deadline (no thread starts yet)."""
  # The line a process logs as it leaves after a peer failure (see
  # `liveness.peer_loss_exit`) tells where its main thread is, as
  # where-reports do.
  rt.watchdog = watchdog.Watchdog(
      rt, describe=lambda: where_text.main_thread(where.local_report(rt)))
  rt.where = where.Responder(rt)
  rt.stalls = stalls.Stalls(rt)
  rt.live_blocks = live_devices.Blocks()
  # A stuck step's report says where every process is (where-reports carry
  # each one's step), and the process leaves as after a peer failure.
  rt.step_watch = step_deadline.StepWatch(
      rt, ask=lambda processes: where.ask(processes, runtime=rt),
      describe=lambda reports: where_text.whereabouts(
          reports, where.ANSWER_WITHIN_S),
      leave=rt.watchdog.leave,
      leave_report=lambda report: where.leave_report(report, runtime=rt),
      left_reports=lambda: where.left_reports(runtime=rt))


runtime.set_assembler(assemble)
