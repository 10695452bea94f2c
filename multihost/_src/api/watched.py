"""Public function: call_watched, for blocking calls outside multihost that every process takes part in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import TypeVar

from multihost._src.liveness import blocking
from multihost._src.runtime import process

T = TypeVar('T')


def call_watched(fn: Callable[..., T], *args: Any, op: str,
                 timeout: float | None = None) -> T:
  """Runs `fn(*args)`; raises ProcessFailureError here if a peer dies meanwhile.

  For blocking calls that every process takes part in but that multihost does
  not make itself, e.g. a checkpoint library's save, commit or restore,
  whose barriers would otherwise wait for a dead peer until their own
  timeout, or forever. `fn` runs on a worker thread; when the failure
  watchdog sees a peer gone, this thread raises `ProcessFailureError` naming
  it, and the worker is abandoned (the process can still save local state,
  log and exit; at exit it leaves with status 1 if the worker is still
  stuck). A peer that left normally (it may have done its part already, as
  Orbax's non-primary processes do before the primary commits) is waited
  for 5 s first: a call that ends by then returns. Without failure
  detection (one process, or `detect_failures=False`) only the timeout is
  watched.

  Args:
    fn: the blocking call.
    *args: its arguments.
    op: a name for it, used in error messages.
    timeout: seconds after which to give up with `CollectiveTimeoutError`
      (default: the process-wide default, see
      `multihost.set_default_timeout`).

  Returns:
    What `fn` returns.

  Raises:
    ProcessFailureError: a peer failed before `fn` returned.
    CollectiveTimeoutError: `fn` did not return within `timeout`.
  """
  return blocking.call(op, fn, *args,
                        timeout=process.resolve_timeout(timeout),
                        met_elsewhere=True)
