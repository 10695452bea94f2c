"""Control plane: the timed barrier of the live processes that a live_devices block meets at (entry and exit).

A coordination-service barrier over the live processes only, waited in
windows of `WINDOW_S` and retried with the live set read again, so that a
death during the wait ends it within the watchdog's bound; the statuses of
the bodies that raised are published beside it (MAC'd with the job key).
Its gave-up and presence marks are the control plane's (`auth.marks`,
authenticated): a mark that anyone who reaches the store planted is ignored.
"""

from __future__ import annotations

import hashlib
import time

from multihost._src.auth import marks as _marks
from multihost._src.auth import secret as _secret
from multihost._src.diagnostics import stalls
from multihost._src.diagnostics import where as _where
from multihost._src.runtime import coordination
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import runtime as _runtime

OP = 'live_devices'
_ROOT = 'multihost_live'
# One barrier window: the service checks barrier deadlines about once a
# second, so a shorter window would not notice a change sooner.
WINDOW_S = 1.0
# A barrier call that fails at once is retried after this long, not at once.
_RETRY_S = 0.1
# Barrier ids cycle over this many blocks: the service keeps every id it has
# seen, and a block's barrier is done before the id comes round again.
_IDS = 8
# Keys are grouped by this many blocks; a group is deleted two groups later.
_GROUP = 16


def merge(previous: frozenset[int] | None, asked: frozenset[int],
           live: frozenset[int]) -> frozenset[int]:
  """The known live set: `live` for the processes `asked` about, `previous` for the rest."""
  return live | ((previous or frozenset()) - asked)


def meet(who: str, n: int, phase: str, candidates: frozenset[int], *,
          timeout: float, status: bytes = b'',
          runtime: _runtime.Runtime | None = None
          ) -> tuple[frozenset[int], dict[int, bytes]]:
  """The barrier of block `n` (of the processes `who`) at `phase`, over the live `candidates`; returns (who met, each one's status).

  Collective: every live process of `candidates` must call this, in the
  same order. `runtime` is this process's (default: the current one).

  Raises:
    CollectiveTimeoutError: a live process did not arrive within `timeout`
      (named, with where it is), or this one came after the others gave up.
  """
  rt = runtime or _runtime.current()
  client = rt.client or coordination.require_client()
  me = rt.index
  start = time.monotonic()
  deadline = start + timeout
  group = f'{_ROOT}/{who}/{n // _GROUP}/'
  # A status for each body that raised; the marks beside it (`_marks`).
  statuses_dir = f'{group}{n}/{phase}/'
  here = _marks.beside(statuses_dir, _marks.HERE)  # once a window expired
  if (phase == 'enter' and n % _GROUP == 0 and n >= 2 * _GROUP
      and me == min(candidates)):
    # Nobody reads that group now.
    client.kv_delete(f'{_ROOT}/{who}/{n // _GROUP - 2}/')
  secret = _secret.job_secret(OP, timeout=timeout, runtime=rt)
  if status:
    key = statuses_dir + str(me)
    client.kv_set(key, _marks.mac(secret, key, status) + status)
  stall = None
  dog = rt.watchdog
  while True:
    live = frozenset(candidates - set(dog.failed_processes())) | {me}
    remaining = deadline - time.monotonic()
    if remaining <= 0:
      stalls.disarm(stall, runtime=rt)
      missing = sorted(live - present(rt, here, live))
      # Who this process gave up on, for those still waiting.
      _marks.leave_mark(rt, OP, statuses_dir, start, given_up_on=missing)
      raise _where.with_whereabouts(
          timed_out(rt, phase, n, missing, time.monotonic() - start, timeout),
          runtime=rt)
    attempt = time.monotonic()
    try:
      client.wait_at_barrier(barrier_id(who, phase, n, live),
                             min(WINDOW_S, remaining), sorted(live))
      break
    except Exception:  # The client raises JaxRuntimeError.  # noqa: BLE001
      pass  # A window passed (or the live sets differed): look again.
    if stall is None:  # The slow path: say who is here, watch for a stall.
      _marks.leave_presence(rt, OP, here)
      stall = stalls.arm(
          f'{OP} ({phase} of block {n})', started=start, until=deadline,
          # The latest live set, on purpose: the loop rebinds it.
          missing=lambda: sorted(live - present(rt, here, live)),  # noqa: B023
          runtime=rt)
    marks = _marks.gave_up(rt, OP, statuses_dir, processes=candidates)
    if marks:  # Another process timed out: so does this.
      stalls.disarm(stall, runtime=rt)
      waited = time.monotonic() - start
      given_up_on = frozenset().union(*(m.given_up_on for m in marks))
      if me in given_up_on:  # It gave up on this one: it came too late.
        raise failures.arrived_late(
            f'{OP} ({phase} of block {n})', me=me, waited=waited,
            timeout=timeout, late_by=_marks.late_by(marks, start),
            source=rt.timeout_source(timeout))
      raise _where.with_whereabouts(timed_out(
          rt, phase, n, sorted(given_up_on), waited, timeout), runtime=rt)
    time.sleep(max(0.0, _RETRY_S - (time.monotonic() - attempt)))
  stalls.disarm(stall, runtime=rt)
  statuses = {}
  if phase == 'exit':  # Every status was published before the barrier.
    for k, stored in client.kv_dir(statuses_dir):
      p = process_of(k, statuses_dir)
      if p in live:
        if not _marks.authentic(secret, k, stored):
          raise failures.forged_message(OP, k, me=me)
        statuses[p] = stored[_marks.MAC:]
  return live, statuses


def digest(processes: frozenset[int]) -> str:
  return hashlib.sha256(repr(sorted(processes)).encode()).hexdigest()[:12]


def barrier_id(who: str, phase: str, n: int, live: frozenset[int]) -> str:
  """The barrier of block `n` of `who` at `phase` among `live`.

  The service fixes a barrier id's processes at its first use (another set
  is refused), so the id names the set: processes that see different live
  sets wait at different barriers, and retry once their views agree.
  """
  return f'{_ROOT}/{who}/{phase}/{n % _IDS}/{digest(live)}'


def process_of(key: str, prefix: str) -> int | None:
  rest = key[len(prefix):]
  return int(rest) if key.startswith(prefix) and rest.isdigit() else None


def present(rt: _runtime.Runtime, here: str,
            live: frozenset[int]) -> frozenset[int]:
  """The processes of `live` with an authentic presence mark under `here` (none if the store is gone)."""
  return frozenset(_marks.published(rt, OP, here, live))


def timed_out(rt: _runtime.Runtime, phase: str, n: int, missing: list[int],
              waited: float, timeout: float) -> errors.CollectiveTimeoutError:
  where = 'start' if phase == 'enter' else 'end'
  return errors.CollectiveTimeoutError(
      f'{rt.prefix} {OP}: timed out after {waited:.1f} s '
      f'(timeout={timeout:g} s) at the {where} of block {n}, waiting for '
      f'process(es) {missing}, which the coordination service still sees '
      f'alive. A process may be stuck in the block\'s body (e.g. in a device '
      f'collective over a dead process\'s device) or slow. '
      f'{failures.SAME_ORDER}, or '
      f'{failures.larger_timeout(rt.timeout_source(timeout))}.',
      operation=OP, missing=missing, waited=waited)
