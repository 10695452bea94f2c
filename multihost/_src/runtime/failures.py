"""Runtime: every message's prefix, its advice, and the named errors of low-level failures.

The one place that turns what went wrong below the collectives (a
coordination-service error, a broken TCP connection, a stuck device
collective, a peer the watchdog saw die) into a `MultihostError` naming the
process, the operation, what happened and what to do now. It makes no
blocking call and holds no state: callers pass the facts (what the watchdog
knows, which processes published) in.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable

from multihost._src.runtime import errors
from multihost._src.runtime import runtime

RESTART = 'save what you can and restart the job.'
SAME_ORDER = ('Check that every process calls the same collectives in the '
              'same order')
_LARGER_TIMEOUT = {
    'argument': 'pass a larger timeout=',
    'setter': ('pass a larger value to multihost.set_default_timeout(), which '
               'set this timeout (or a larger timeout= to this call)'),
    'environment': ('set a larger $MULTIHOST_TIMEOUT, which set this timeout '
                    '(or pass a larger timeout= to this call)'),
    'default': ('pass a larger timeout= (the default is 300 s; '
                'multihost.set_default_timeout() or $MULTIHOST_TIMEOUT '
                'change it for every collective)'),
}


def larger_timeout(source: str = 'argument') -> str:
  """The advice to raise a timeout, naming what set it (see `Runtime.timeout_source`)."""
  return _LARGER_TIMEOUT.get(source, _LARGER_TIMEOUT['argument'])
BUG = 'This is a bug in multihost; please report it.'


def prefix(index: int | None = None) -> str:
  """'[process=N]' for this process (or for `index`), the start of every message."""
  if index is None:
    return runtime.current().prefix
  return f'[process={index}]'


def shorten(message: object, limit: int = 400) -> str:
  """`message` (a string or an exception) on one line, cut to `limit` characters."""
  text = ' '.join(str(message).split())
  return text if len(text) <= limit else text[:limit] + '...'


def groups(values: list, render: Callable[[object], str] = repr) -> str:
  """'processes [0, 2]: 'a'; process [1]: 'b'' for per-process values."""
  by_value: dict = {}
  for p, v in enumerate(values):
    by_value.setdefault(v, []).append(p)
  parts = []
  for v, ps in by_value.items():
    noun = 'process' if len(ps) == 1 else 'processes'
    parts.append(f'{noun} {ps}: {render(v)}')
  return '; '.join(parts)


def minority(values: list) -> list[int]:
  """Processes whose value is not the most common one (ties: not process 0's)."""
  counts: dict = {}
  for v in values:
    counts[v] = counts.get(v, 0) + 1
  majority = max(counts, key=lambda v: (counts[v], v == values[0]))
  return [p for p, v in enumerate(values) if v != majority]


# --- The coordination service (control plane) ------------------------------


def coordination_failure(
    error: BaseException, op: str, *, me: int, count: int, waited: float,
    timeout: float, known: errors.ProcessFailureError | None,
    tasks: list[int], published: Callable[[], Iterable[int]] | None = None,
    source: str = 'argument',
) -> errors.MultihostError:
  """Names a coordination-service error of collective `op`.

  Args:
    error: what the client raised.
    op: the collective.
    me: this process's index.
    count: the number of processes.
    waited: seconds waited in the collective so far.
    timeout: the collective's timeout.
    known: the watchdog's error when it already knows a peer is gone.
    tasks: the processes the service's message names (`task:N`).
    published: the processes that published their message (asked only when
      the service's message names nobody).
    source: what set `timeout` (see `larger_timeout`).
  """
  if isinstance(error, errors.MultihostError):  # Already named (watchdog).
    return error
  message = str(error)
  if known is not None:
    return known
  if 'UNAVAILABLE' in message and ('coordination service' in message or
                                   'failed to connect' in message):
    return errors.ProcessFailureError(
        f'{prefix(me)} {op}: the coordination service (hosted by process '
        f'0) is unreachable after {waited:.1f} s; process 0 has probably '
        f'failed. Underlying error: {shorten(message)}',
        operation=op, failed=[0])
  if 'heartbeat' in message or 'unhealthy' in message:
    dead = [t for t in tasks if t != me]
    return errors.ProcessFailureError(
        f'{prefix(me)} {op}: process(es) {dead} failed (the coordination '
        f'service reports missed heartbeats) after {waited:.1f} s. The '
        f'collective cannot complete; {RESTART}',
        operation=op, failed=dead)
  missing = [t for t in tasks if t != me]
  if not missing and published is not None:
    present = set(published())
    missing = [p for p in range(count) if p not in present]
  if 'DEADLINE_EXCEEDED' in message or waited >= timeout * 0.99:
    if not missing:
      return arrived_late(op, me=me, waited=waited, timeout=timeout,
                          source=source)
    return errors.CollectiveTimeoutError(
        f'{prefix(me)} {op}: timed out after {waited:.1f} s (timeout='
        f'{timeout:g} s) waiting for process(es) {missing} to arrive. '
        f'{SAME_ORDER}, or {larger_timeout(source)}.',
        operation=op, missing=missing, waited=waited)
  return errors.MultihostError(
      f'{prefix(me)} {op}: the coordination-service barrier failed after '
      f'{waited:.1f} s: {shorten(message)}')


def forged_message(op: str, key: str, *, planted: bool = False,
                   me: int | None = None) -> errors.MultihostError:
  what = ('is not the key of any process of this call' if planted else
          'failed authentication with the job secret')
  return errors.MultihostError(
      f'{prefix(me)} {op}: the control message under key {key!r} of the '
      f'coordination service {what}: someone who reached the coordination '
      'service planted or altered it. Nothing in it was decoded. Restart the '
      'job, and firewall the coordination service (see docs/trust.md, "Trust '
      'model").')


def arrived_late(op: str, *, me: int, waited: float, timeout: float,
                 late_by: float | None = None,
                 source: str = 'argument') -> errors.CollectiveTimeoutError:
  """This process reached a collective the others had already given up on.

  Args:
    op: the collective.
    me: this process's index.
    waited: seconds this process spent in the collective.
    timeout: the collective's timeout.
    late_by: seconds by which this process started the collective after
      the others (by the hosts' wall clocks), when known.
    source: what set `timeout` (see `larger_timeout`).
  """
  if late_by is None:
    when = 'it got there after they gave up'
  else:
    when = f'it got there {late_by:.1f} s after them'
  return errors.CollectiveTimeoutError(
      f'{prefix(me)} {op}: this process arrived late: the other '
      f'processes had already given up waiting for it (timeout={timeout:g} '
      f's); {when}. Find what delayed process {me}, or '
      f'{larger_timeout(source)}.',
      operation=op, missing=[me], waited=waited)


def messages_missing(op: str, missing: list[int], *,
                     me: int | None = None) -> errors.MultihostError:
  """A completed barrier whose messages are not all in the key-value store."""
  return errors.MultihostError(
      f'{prefix(me)} {op}: the barrier completed but the messages of processes '
      f'{missing} are missing from the coordination service. {BUG}')


def different_collectives(ops: list[str], *,
                          me: int | None = None) -> errors.ConsistencyError:
  return errors.ConsistencyError(
      f'{prefix(me)} processes called different collectives at the same point: '
      f'{groups(ops)}. Every process must call the same multihost '
      'collectives in the same order.')


# --- Peers gone (the watchdog's findings) ----------------------------------


def process_failure(op: str, *, me: int, failed: list[int],
                    exited: list[int], service_lost: bool,
                    waited: float | None, bound: float,
                    cause: BaseException | None = None
                    ) -> errors.ProcessFailureError:
  """A `ProcessFailureError` for `op` naming the processes known gone."""
  where = f' {op}:' if op else ''
  parts = []
  if failed:
    parts.append(f'process(es) {failed} failed (the coordination service '
                 'stopped receiving their heartbeats)')
  if exited:
    parts.append(f'process(es) {exited} exited before this collective')
  if service_lost and not failed:
    parts.append('the coordination service is unreachable, so process 0 '
                 '(or the launcher) that hosts it has probably failed')
    failed = [0]
  if not parts:
    parts.append('a peer closed its connection during a device collective, '
                 'but the coordination service still sees every process '
                 f'alive after {bound:.0f} s')
  after = '' if waited is None else f' (after waiting {waited:.1f} s)'
  detail = '' if cause is None else f' Underlying error: {shorten(cause, 300)}'
  return errors.ProcessFailureError(
      f'{prefix(me)}{where} {"; ".join(parts)}{after}. The collective '
      'cannot complete, and this process can no longer run collectives: '
      'save what you can locally, exit with a non-zero status, and restart '
      f'the job (e.g. from the last checkpoint).{detail}',
      operation=op, failed=failed + exited)


def step_timeout(op: str, *, me: int, waited: float, timeout: float,
                 source: str = 'argument') -> errors.CollectiveTimeoutError:
  """A watched blocking step (a device collective) that did not complete."""
  return errors.CollectiveTimeoutError(
      f'{prefix(me)} {op}: the device collective did not complete in '
      f'{waited:.1f} s (timeout={timeout:g} s), and the coordination '
      'service still sees every process alive. A process may be stuck or '
      f'very slow; {larger_timeout(source)} if the transfer is legitimately '
      'this slow.', operation=op, waited=waited)


# --- The TCP data plane ----------------------------------------------------


def transfer_timeout(op: str, peer: int, what: str, *,
                     me: int | None = None) -> errors.CollectiveTimeoutError:
  return errors.CollectiveTimeoutError(
      f'{prefix(me)} {op}: timed out waiting for process {peer} {what}. It may '
      'be stuck or slow; pass a larger timeout= if the transfer is '
      'legitimately this slow.', operation=op, missing=[peer])


_TCP_BLOCKED = (
    'The TCP data plane needs each controller to reach the others on the '
    'port it publishes (an ephemeral port on the address that reaches the '
    'coordinator); a firewall that lets only the coordinator\'s port through '
    'blocks it. Open TCP between the hosts, or set MULTIHOST_TRANSPORT=device '
    'on every process to move payloads over JAX device collectives instead.')


def cannot_connect(op: str, peer: int, address: str,
                   error: BaseException) -> errors.MultihostError:
  """Opening the data-plane connection to a live `peer` failed."""
  return errors.MultihostError(
      f'{prefix()} {op}: cannot open a data-plane connection to process '
      f'{peer} at {address} ({type(error).__name__}: {error}), and process '
      f'{peer} is not known to have failed. {_TCP_BLOCKED}')


def connect_timeout(op: str, peer: int,
                    address: str | None) -> errors.CollectiveTimeoutError:
  """No data-plane connection with `peer` within the timeout."""
  where = (f'to accept a data-plane connection at {address}' if address
           else 'to open its data-plane connection to this process')
  return errors.CollectiveTimeoutError(
      f'{prefix()} {op}: timed out waiting for process {peer} {where}. It may '
      f'be stuck or slow, or the connection may be blocked. {_TCP_BLOCKED}',
      operation=op, missing=[peer])


def connection_failure(op: str, peer: int, error: BaseException,
                       dead: list[int]) -> errors.ProcessFailureError:
  return errors.ProcessFailureError(
      f'{prefix()} {op}: the connection to process {peer} failed ({error}); '
      f'process(es) {dead} failed. The collective cannot complete; {RESTART}',
      operation=op, failed=dead)


def connection_cut(op: str, peer: int,
                   error: BaseException) -> errors.MultihostError:
  return errors.MultihostError(
      f'{prefix()} {op}: the connection to process {peer} broke ({error}), '
      'but no process is known to have failed: the network (or someone on '
      'it) cut or truncated the connection. Nothing from this transfer was '
      'delivered. Restart the job, and check the network path.')


def forged_frame(op: str, peer: int, what: str) -> errors.MultihostError:
  return errors.MultihostError(
      f'{prefix()} {op}: a frame header on the authenticated connection from '
      f'process {peer} {what}. Someone on the network path injected, replayed '
      f'or altered bytes; process {peer} itself is not known to have failed, '
      'and nothing from this transfer was delivered. Restart the job, and '
      'firewall the data-plane ports (see docs/trust.md, "Trust model").')


def out_of_step(op: str, peer: int, got: tuple[int, int],
                want: tuple[int, int]) -> errors.MultihostError:
  return errors.MultihostError(
      f'{prefix()} {op}: process {peer} sent call {got[0]} ({got[1]} bytes) '
      f'where call {want[0]} ({want[1]} bytes) was expected: the processes '
      'are out of step. This is a bug in multihost (or a collective was '
      'abandoned after an error); restart the job.')


def given_up_elsewhere(op: str, *, me: int, by: int, waited: float,
                       timeout: float,
                       source: str = 'argument') -> errors.CollectiveTimeoutError:
  """A process that completed the agreement, but after process `by` had given the call up at its timeout (the call's outcome record says so)."""
  return errors.CollectiveTimeoutError(
      f'{prefix(me)} {op}: process {by} gave this call up at its timeout '
      f'before this process completed it (after {waited:.1f} s here, '
      f'timeout={timeout:g} s): every process raises, so that none returns '
      f'what another did not. Process {by}\'s error names who was late. '
      f'Find what delayed that process, or {larger_timeout(source)}.',
      operation=op, waited=waited)


# --- Where the processes are (see `diagnostics.where`) --------------------------------


def retell(error: errors.MultihostError,
           message: str) -> errors.MultihostError:
  """A copy of `error` (same type and attributes) with `message`."""
  if isinstance(error, errors.CollectiveTimeoutError):
    return type(error)(message, operation=error.operation,
                       missing=error.missing, waited=error.waited)
  if isinstance(error, errors.ProcessFailureError):
    return type(error)(message, operation=error.operation,
                       failed=error.failed)
  return type(error)(message)


def name_barrier(message: str, name: str) -> str:
  """`message` of a sync_global_devices error, with the barrier's name after the op."""
  op = 'sync_global_devices'
  if f'{op}:' in message:
    return message.replace(f'{op}:', f'{op}({name!r}):', 1)
  return f'{message} (barrier {name!r})'
