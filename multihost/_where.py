"""Diagnostics: where every process is (its Python stacks and last collective), answered by a daemon thread.

Each process runs a daemon thread (`multihost-where`) that waits on the
coordination service's key-value store for requests and answers them with
this process's report: every thread's innermost Python frames (main thread
first, read with `sys._current_frames()`, so a main thread stuck in user
code or in a blocking call that releases the GIL does not matter) and its
last collectives from the flight recorder (`_flight`). The requester writes
`multihost_where/req/<n>` naming the processes it asks (n from an atomic
counter); every thread reads the requests in order, blocked in one key-value
get with a 1 s timeout at a time, and the processes named answer under
`multihost_where/resp/<n>/<process>`. A process that does not answer within
`ANSWER_WITHIN_S` is reported as not answering: it is then likely dead, or
wedged in C++ while holding the GIL.

Users of it: a collective that times out puts the missing processes'
reports into its `CollectiveTimeoutError` (`with_whereabouts`); a
collective still waiting after the stall threshold logs one line with the
same report (`watch_stall`); `multihost.where()` asks everyone; and SIGUSR1
makes a process print its own report (the launcher forwards it). None of it
runs on the fast path of a collective, and nothing runs without
`jax.distributed`.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback

from absl import logging

from multihost import _coordination
from multihost import _diagnostics
from multihost import _errors
from multihost import _flight
from multihost import env as _env

# How long a requester waits for the answers.
ANSWER_WITHIN_S = 1.5
# The responder's key-value get timeout (bounds how long exit waits for it).
_POLL_S = 1.0
# After this many empty polls on one request number, check whether its
# requester died between numbering and writing it (then skip it).
_SKIP_AFTER_POLLS = 10
_DIR = 'multihost_where/'
# Frames kept per thread in a report (innermost).
_FRAMES = 12
_DEFAULT_STALL_S = 60.0


class _State:

  def __init__(self):
    self.lock = threading.Lock()
    self.started = False
    self.attempted = False
    self.stopping = False
    self.responder: threading.Thread | None = None
    self.stall_after: float | None = None  # None: $MULTIHOST_STALL_REPORT_AFTER
    self.stall_cond = threading.Condition()
    self.stalls: dict[int, tuple] = {}  # token -> (deadline, op, missing())
    self.stall_thread: threading.Thread | None = None
    self.next_token = 0


_state = _State()


# --- This process's report --------------------------------------------------


def local_report() -> dict:
  """This process's report (JSON-able): its threads' innermost frames, main first, and its last collectives."""
  frames = sys._current_frames()  # pylint: disable=protected-access
  names = {t.ident: t.name for t in threading.enumerate()}
  main = threading.main_thread().ident
  me = threading.get_ident()
  threads = []
  for ident, frame in sorted(frames.items(), key=lambda kv: kv[0] != main):
    if ident == me and ident != main:
      continue  # The reporting thread itself.
    stack = traceback.extract_stack(frame)[-_FRAMES:]
    threads.append({
        'name': names.get(ident, f'thread {ident}'),
        'main': ident == main,
        'frames': [[_short(f.filename), f.lineno, f.name] for f in stack],
    })
  now = time.monotonic()
  last = _flight.last_completed()
  current = _flight.in_progress()
  return {
      'process': _process_index(),
      'pid': os.getpid(),
      'host': socket.gethostname(),
      'threads': threads,
      'last': None if last is None else {'label': last.label(),
                                         'ago': now - last.end},
      'now_in': None if current is None else {
          'label': current.label(), 'for': now - current.start},
  }


def _short(path: str) -> str:
  parts = path.replace('\\', '/').split('/')
  return '/'.join(parts[-2:])


def _process_index() -> int:
  if _coordination.client() is None:
    return 0
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index()


def _process_count() -> int:
  if _coordination.client() is None:
    return 1
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_count()


# --- Asking -----------------------------------------------------------------


def ask(processes: list[int], *, timeout: float = ANSWER_WITHIN_S
        ) -> dict[int, dict | None]:
  """Each of `processes`'s report, or None for a process that did not answer within `timeout`.

  Not a collective: the other processes' daemon threads answer. This
  process answers for itself directly.
  """
  reports: dict[int, dict | None] = {}
  me = _process_index()
  others = [p for p in processes if p != me]
  if me in processes:
    reports[me] = local_report()
  if not others:
    return reports
  if _coordination.client() is None:
    return {**reports, **{p: None for p in others}}
  try:
    n = _coordination.kv_increment(_DIR + 'count', 1) - 1
    _coordination.kv_set(f'{_DIR}req/{n}', json.dumps(
        {'from': me, 'to': others}).encode())
  except Exception:  # The service is gone: nobody can answer.  # noqa: BLE001
    return {**reports, **{p: None for p in others}}
  deadline = time.monotonic() + timeout
  for p in others:
    try:
      answer = _coordination.kv_get(f'{_DIR}resp/{n}/{p}',
                                    max(0.001, deadline - time.monotonic()))
      reports[p] = json.loads(answer)
    except Exception:  # Not in time.  # noqa: BLE001
      reports[p] = None
  try:
    _coordination.kv_delete(f'{_DIR}resp/{n}/')
  except Exception:  # noqa: BLE001
    pass
  return dict(sorted(reports.items()))


def where(processes: list[int] | None = None, *,
          timeout: float = ANSWER_WITHIN_S) -> str:
  """Where every process (or each of `processes`) is: its threads' innermost frames and its last collective.

  Not a collective: call it from any process, at any time (e.g. from a
  debugger while the job hangs). Every other process answers from a daemon
  thread, even when its main thread is stuck; one that does not answer
  within `timeout` seconds is reported as not answering (likely dead, or
  wedged in C++). Without `jax.distributed`, the report of this process.

  Returns:
    The report, several lines per process.
  """
  if processes is None:
    processes = list(range(_process_count()))
  return _diagnostics.where_text(ask(list(processes), timeout=timeout),
                                 timeout=timeout)


def with_whereabouts(error: _errors.MultihostError) -> _errors.MultihostError:
  """`error`, and if it is a timeout, where its missing processes are (asked now)."""
  if not isinstance(error, _errors.CollectiveTimeoutError):
    return error
  others = [p for p in error.missing if p != _process_index()]
  if not others:
    return error
  reports = ask(others)
  return _diagnostics.retell(
      error, f'{error} {_diagnostics.whereabouts(reports, ANSWER_WITHIN_S)}')


# --- The daemon threads -----------------------------------------------------


def ensure_started() -> None:
  """Starts the responder (and, on the main thread, the SIGUSR1 reporter) once, if jax.distributed is up."""
  if _state.attempted:
    return
  start()


def start() -> bool:
  """Starts the daemon threads (once); returns whether the responder runs."""
  st = _state
  with st.lock:
    if st.started or st.stopping:
      return st.started
    if _coordination.client() is None:
      return False
    st.attempted = True
    try:
      first = _coordination.kv_increment(_DIR + 'count', 0)
    except Exception as e:  # noqa: BLE001
      logging.warning('%s multihost: no where-reporter (%s).',
                      _diagnostics.prefix(), _diagnostics.shorten(e, 200))
      return False
    st.started = True
    st.responder = threading.Thread(target=_serve, args=(first,),
                                    name='multihost-where', daemon=True)
    st.responder.start()
  _install_sigusr1()
  # Registered after the watchdog's (in `multihost.initialize`), so it runs
  # first: no thread of ours is inside a key-value get at disconnection.
  atexit.register(stop)
  return True


def stop() -> None:
  """Stops the responder: wakes it with an empty request and joins it."""
  st = _state
  with st.lock:
    if not st.started or st.stopping:
      return
    st.stopping = True
  try:
    if _coordination.client() is not None:
      n = _coordination.kv_increment(_DIR + 'count', 1) - 1
      _coordination.kv_set(f'{_DIR}req/{n}', b'{"to": []}')
  except Exception:  # noqa: BLE001
    pass
  if st.responder is not None:
    st.responder.join(_POLL_S + 1.0)


def _serve(n: int) -> None:
  st = _state
  me = _process_index()
  idle = 0
  while not st.stopping:
    try:
      value = _coordination.kv_get(f'{_DIR}req/{n}', _POLL_S)
    except Exception as e:  # noqa: BLE001
      if st.stopping or _coordination.client() is None:
        return
      if 'DEADLINE_EXCEEDED' in str(e) or 'NOT_FOUND' in str(e):
        idle += 1
        if idle % _SKIP_AFTER_POLLS == 0 and _skip_gap(n):
          n += 1  # A requester took number n and never wrote it.
        continue
      time.sleep(_POLL_S)  # The service is unreachable; keep trying slowly.
      continue
    idle = 0
    try:
      request = json.loads(value)
      if me in request.get('to', ()):
        _coordination.kv_set(f'{_DIR}resp/{n}/{me}',
                             json.dumps(local_report()).encode())
    except Exception as e:  # Never let the reporter die.  # noqa: BLE001
      logging.warning('%s multihost: could not answer where-request %d: %s',
                      _diagnostics.prefix(me), n, _diagnostics.shorten(e, 200))
    n += 1


def _skip_gap(n: int) -> bool:
  """Whether request n was numbered but never written while later ones exist."""
  try:
    return _coordination.kv_increment(_DIR + 'count', 0) > n + 1
  except Exception:  # noqa: BLE001
    return False


def _install_sigusr1() -> None:
  """On SIGUSR1, a daemon thread prints this process's report to stderr.

  Python runs signal handlers on the main thread only, which may be stuck;
  but its C-level handler also writes the signal's number to the wakeup fd
  at once, from any thread, and a daemon thread waits on that. Installed
  only from the main thread, when SIGUSR1 has its default action and no
  wakeup fd is set (otherwise someone else owns them).
  """
  if threading.current_thread() is not threading.main_thread():
    return
  if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
    return
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  try:
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  except ValueError:
    os.close(read_fd)
    os.close(write_fd)
    return
  if previous != -1:  # Someone else's: put it back.
    signal.set_wakeup_fd(previous)
    os.close(read_fd)
    os.close(write_fd)
    return
  signal.signal(signal.SIGUSR1, lambda signum, frame: None)
  threading.Thread(target=_report_on_signal, args=(read_fd,),
                   name='multihost-where-signal', daemon=True).start()


def _report_on_signal(read_fd: int) -> None:
  while True:
    select.select([read_fd], [], [])
    data = os.read(read_fd, 512)
    if signal.SIGUSR1 in data:
      text = _diagnostics.where_text({_process_index(): local_report()},
                                     timeout=0.0, title='on SIGUSR1')
      try:
        sys.stderr.write(text + '\n')
        sys.stderr.flush()
      except Exception:  # noqa: BLE001
        pass


# --- Stall reports ----------------------------------------------------------


def set_stall_report_after(seconds: float | None) -> None:
  """Sets after how many seconds of waiting a collective logs where the missing processes are.

  Args:
    seconds: a number of seconds (0 turns stall reports off), or None to go
      back to $MULTIHOST_STALL_REPORT_AFTER (or 60 s when it is unset).
  """
  if seconds is not None and not seconds >= 0:
    raise ValueError(
        f'The stall report threshold must be >= 0 seconds (0: off); got '
        f'{seconds!r}. Pass None to fall back to '
        f'${_env.STALL_REPORT_AFTER} or {_DEFAULT_STALL_S:g} s.')
  _state.stall_after = None if seconds is None else float(seconds)


def stall_report_after() -> float:
  """Seconds a collective waits before it logs a stall report (0: never)."""
  if _state.stall_after is not None:
    return _state.stall_after
  return _env.number(_env.STALL_REPORT_AFTER, _DEFAULT_STALL_S,
                     unit='seconds', example='60 (0: no stall reports)',
                     zero_ok=True)


def watch_stall(op: str, *, started: float, until: float, missing) -> int | None:
  """Arranges one stall report if the wait of `op` (started at `started`) lasts past the threshold.

  For slow paths only (it takes a lock). `until` is when the wait times out
  (time.monotonic()); `missing()` returns the processes that have not
  arrived. Returns a token for `stall_done`, or None when no report can be
  due before the timeout.
  """
  after = stall_report_after()
  if after <= 0 or started + after >= until or _coordination.client() is None:
    return None
  st = _state
  with st.stall_cond:
    token = st.next_token
    st.next_token += 1
    st.stalls[token] = (started + after, after, op, missing)
    if st.stall_thread is None:
      st.stall_thread = threading.Thread(target=_report_stalls,
                                         name='multihost-stall', daemon=True)
      st.stall_thread.start()
    st.stall_cond.notify()
  return token


def stall_done(token: int | None) -> None:
  """The wait of `watch_stall`'s token ended (no report from now on)."""
  if token is None:
    return
  with _state.stall_cond:
    _state.stalls.pop(token, None)


def _report_stalls() -> None:
  st = _state
  while True:
    with st.stall_cond:
      while True:
        now = time.monotonic()
        due = [(t, s) for t, s in st.stalls.items() if s[0] <= now]
        if due:
          token, (_, after, op, missing) = due[0]
          del st.stalls[token]
          break
        wake = min((s[0] for s in st.stalls.values()), default=None)
        st.stall_cond.wait(None if wake is None else wake - now)
    try:
      me = _process_index()
      others = [p for p in missing() if p != me]
      reports = ask(others) if others else {}
      current = _flight.in_progress()  # The call waiting (named).
      label = current.label() if current and current.op == op else op
      logging.warning('%s', _diagnostics.stall_line(
          label, waited=after, reports=reports, timeout=ANSWER_WITHIN_S))
    except Exception as e:  # noqa: BLE001
      logging.warning('%s multihost: stall report failed: %s',
                      _diagnostics.prefix(), _diagnostics.shorten(e, 200))
