"""Diagnostics: where every process is (its Python stacks and last collective), answered by a daemon thread.

Each process runs a daemon thread (`multihost-where`, the responder) that
waits on the coordination service's key-value store for requests and
answers them with this process's report: every thread's innermost Python
frames (main thread first, read with `sys._current_frames()`, so a main
thread stuck in user code or in a blocking call that releases the GIL does
not matter), its last collectives from the flight recorder (`runtime.flight`)
and where it is in its training steps (`liveness.step_deadline`).
The requester writes `multihost_where/req/<n>` naming the processes it asks
(n from an atomic counter); every responder reads the requests in order,
blocked in one key-value get with a 1 s timeout at a time, and the processes
named answer under `multihost_where/resp/<n>/<process>`. A process that does
not answer within `ANSWER_WITHIN_S` is reported as not answering: it is then
likely dead, or wedged in C++ while holding the GIL. Requests and answers
carry a MAC under the job key (`auth.secret`), are size-capped, and the
requester deletes them once answered: someone who can write to the store
but lacks the job secret is not answered, and a request number taken but
never written (or a counter bumped far ahead) is skipped at the next idle
poll, when the responder lists the pending requests and answers every
authentic one it has not answered yet (a request written just after its
number's poll gave up, behind a later one, is answered then, not lost).

Users of it: a collective that times out puts the missing processes'
reports into its `CollectiveTimeoutError` (`with_whereabouts`); a
collective still waiting after the stall threshold logs one line with the
same report (`diagnostics.stalls`); `multihost.where()` asks everyone; and SIGUSR1
makes a process print its own report (`diagnostics.where_signal`; the launcher
forwards it). None of it runs on the fast path of a collective, and nothing
runs without a coordination service. The reports are rendered by
`diagnostics.where_text`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import sys
import threading
import time
import traceback

from multihost._src.auth import secret
from multihost._src.diagnostics import where_signal
from multihost._src.diagnostics import where_text
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import runtime as _runtime

ANSWER_WITHIN_S = 1.5
# The responder's key-value get timeout (bounds how long exit waits for it).
_POLL_S = 1.0
# Largest request and answer read (bytes); larger ones are ignored.
_MAX_REQUEST = 64 << 10
_MAX_ANSWER = 4 << 20
_MAC = 16
_DIR = 'multihost_where/'
# Frames kept per thread in a report (innermost).
_FRAMES = 12


# --- This process's report --------------------------------------------------


def local_report(runtime: _runtime.Runtime | None = None) -> dict:
  """This process's report (JSON-able): its threads' innermost frames, main first, and its last collectives."""
  rt = runtime or _runtime.current()
  frames = sys._current_frames()  # pylint: disable=protected-access
  names = {t.ident: t.name for t in threading.enumerate()}
  main = threading.main_thread().ident
  me = threading.get_ident()
  program = _program_file()
  threads = []
  for ident, frame in sorted(frames.items(), key=lambda kv: kv[0] != main):
    if ident == me and ident != main:
      continue  # The reporting thread itself.
    stack = traceback.extract_stack(frame)
    own = next((f for f in reversed(stack)
                if program is not None and _same(f.filename, program)), None)
    threads.append({
        'name': names.get(ident, f'thread {ident}'),
        'main': ident == main,
        'frames': [[_short(f.filename), f.lineno, f.name]
                   for f in stack[-_FRAMES:]],
        # The innermost frame of the program's main module (its script), so
        # that a short stack shows where in the program the thread is even
        # when library frames fill it.
        'program': None if own is None else [_short(own.filename),
                                             own.lineno, own.name],
    })
  now = time.monotonic()
  last = rt.flight.last_completed()
  current = rt.flight.in_progress()
  failed = rt.flight.last_failed()
  return {
      'process': _index(rt),
      'pid': os.getpid(),
      'host': socket.gethostname(),
      'threads': threads,
      # `last_completed` and `last_failed` return records with `end` and
      # `failed_at` set; the checks say so to the type checker.
      'last': None if last is None or last.end is None else {
          'label': last.label(), 'ago': now - last.end},
      'now_in': None if current is None else {
          'label': current.label(), 'for': now - current.start},
      'step': rt.step_watch.position(),
      'raised': None if failed is None or failed.failed_at is None else {
          'label': failed.label(), 'error': failed.error,
          'ago': now - failed.failed_at},
  }


def _program_file() -> str | None:
  """The program's main module's file (its script), or None (e.g. an interactive session)."""
  main = sys.modules.get('__main__')
  path = getattr(main, '__file__', None)
  return os.path.abspath(path) if isinstance(path, str) else None


def _same(filename: str, program: str) -> bool:
  return filename == program or os.path.abspath(filename) == program


def _short(path: str) -> str:
  parts = path.replace('\\', '/').split('/')
  return '/'.join(parts[-2:])


def _index(rt: _runtime.Runtime) -> int:
  return 0 if rt.client is None else rt.index


def _count(rt: _runtime.Runtime) -> int:
  return 1 if rt.client is None else rt.count


# --- Authentication ---------------------------------------------------------


def _key(rt: _runtime.Runtime, timeout: float) -> bytes:
  return secret.job_keys('where', timeout=timeout, runtime=rt)[1]


def _seal(key: bytes, name: str, body: bytes) -> bytes:
  return hmac.digest(key, name.encode() + b'\0' + body,
                     hashlib.sha256)[:_MAC] + body


def _unseal(key: bytes, name: str, stored: bytes, limit: int) -> bytes | None:
  """The body under `name` if this job wrote it (and it is not too big); else None."""
  if len(stored) > limit + _MAC or len(stored) < _MAC:
    return None
  body = stored[_MAC:]
  if not hmac.compare_digest(stored, _seal(key, name, body)):
    return None
  return body


# --- Asking -----------------------------------------------------------------


def ask(processes: list[int], *, timeout: float = ANSWER_WITHIN_S,
        runtime: _runtime.Runtime | None = None) -> dict[int, dict | None]:
  """Each of `processes`'s report, or None for a process that did not answer within `timeout`.

  Not a collective: the other processes' responders answer. This process
  answers for itself directly.
  """
  rt = runtime or _runtime.current()
  reports: dict[int, dict | None] = {}
  me = _index(rt)
  others = [p for p in processes if p != me]
  if me in processes:
    reports[me] = local_report(rt)
  if not others:
    return reports
  client = rt.client
  if client is None:
    return {**reports, **{p: None for p in others}}
  deadline = time.monotonic() + timeout
  try:
    key = _key(rt, timeout)
    n = client.kv_increment(_DIR + 'count', 1) - 1
    name = f'{_DIR}req/{n}'
    client.kv_set(name, _seal(key, name, json.dumps(
        {'from': me, 'to': others}).encode()))
  except Exception:  # The service is gone: nobody can answer.  # noqa: BLE001
    return {**reports, **{p: None for p in others}}
  for p in others:
    name = f'{_DIR}resp/{n}/{p}'
    try:
      answer = _unseal(key, name, client.kv_get(
          name, max(0.001, deadline - time.monotonic())), _MAX_ANSWER)
      reports[p] = None if answer is None else json.loads(answer)
    except Exception:  # Not in time.  # noqa: BLE001
      reports[p] = None
  for old in (f'{_DIR}resp/{n}/', f'{_DIR}req/{n}'):
    try:
      client.kv_delete(old)
    except Exception:  # noqa: BLE001
      pass
  return dict(sorted(reports.items()))


# --- The reports of processes that left at a stuck step ----------------------

# Each process whose step deadline fired leaves its own report here before
# it leaves (one key per process, written once: the process then exits), so
# that the others' reports can still say where it was.
_LEFT_DIR = 'multihost_where/left/'


def leave_report(report: dict, *, runtime: _runtime.Runtime | None = None,
                 timeout: float = ANSWER_WITHIN_S) -> None:
  """Leaves this process's `report` in the store for those asking after it has gone (see `left_reports`)."""
  rt = runtime or _runtime.current()
  if rt.client is None:
    return
  name = f'{_LEFT_DIR}{_index(rt)}'
  body = json.dumps(report).encode()
  if len(body) <= _MAX_ANSWER:
    rt.service().kv_set(name, _seal(_key(rt, timeout), name, body))


def left_reports(*, runtime: _runtime.Runtime | None = None,
                 timeout: float = ANSWER_WITHIN_S) -> dict[int, dict]:
  """The reports that processes left as their step deadline fired (`leave_report`), by process; authentic ones only."""
  rt = runtime or _runtime.current()
  if rt.client is None:
    return {}
  key = _key(rt, timeout)
  out = {}
  for name, stored in rt.service().kv_dir(_LEFT_DIR):
    body = _unseal(key, name, stored, _MAX_ANSWER)
    try:
      if body is not None:
        out[int(name.rsplit('/', 1)[1])] = json.loads(body)
    except ValueError:
      continue
  return out


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
  rt = _runtime.current()
  if processes is None:
    processes = list(range(_count(rt)))
  return where_text.where_text(ask(list(processes), timeout=timeout,
                                    runtime=rt), timeout=timeout)


def with_whereabouts(error: errors.MultihostError, *,
                     runtime: _runtime.Runtime | None = None
                     ) -> errors.MultihostError:
  """`error`, and if it is a timeout, where its missing processes are (asked now)."""
  if not isinstance(error, errors.CollectiveTimeoutError):
    return error
  rt = runtime or _runtime.current()
  others = [p for p in error.missing if p != _index(rt)]
  if not others:
    return error
  reports = ask(others, runtime=rt)
  return failures.retell(
      error, f'{error} {where_text.whereabouts(reports, ANSWER_WITHIN_S)}')


# --- The responder ----------------------------------------------------------


class Responder:
  """One process's responder thread (started once, stopped at exit)."""

  def __init__(self, runtime: _runtime.Runtime):
    self.runtime = runtime
    self.lock = threading.Lock()
    self.started = False
    self.attempted = False
    self.stopping = False
    self.thread: threading.Thread | None = None

  def ensure_started(self) -> None:
    """Starts the responder (and, on the main thread, the SIGUSR1 reporter) once, if there is a coordination service."""
    if not self.attempted:
      self.start()

  def start(self) -> bool:
    """Starts the responder (once); returns whether it runs."""
    rt = self.runtime
    with self.lock:
      if self.started or self.stopping:
        return self.started
      if rt.client is None:
        return False
      self.attempted = True
      try:
        first = rt.service().kv_increment(_DIR + 'count', 0)
      except Exception as e:  # noqa: BLE001
        rt.log.warning('multihost: no where-reporter (%s).',
                       failures.shorten(e, 200))
        return False
      if _index(rt) == 0:
        # Process 0 draws the job id now: a peer's timeout error can then ask
        # for process 0's whereabouts even if process 0 never got as far as
        # a collective that needed the job key.
        try:
          secret.job_keys('where', timeout=_POLL_S, runtime=rt)
        except Exception:  # noqa: BLE001  The first collective raises it.
          pass
      self.started = True
      self.thread = threading.Thread(target=self._serve, args=(first,),
                                     name='multihost-where', daemon=True)
      self.thread.start()
    rt.exit_steps['where'] = self.stop
    if rt.raw is not None:  # The process's own runtime, not a test's.
      where_signal.install(lambda: where_text.where_text(
          {_index(rt): local_report(rt)}, timeout=0.0, title='on SIGUSR1'))
    return True

  def stop(self) -> None:
    """Stops the responder: wakes it with an empty request and joins it."""
    rt = self.runtime
    with self.lock:
      if not self.started or self.stopping:
        return
      self.stopping = True
    try:
      if rt.connected():
        n = rt.service().kv_increment(_DIR + 'count', 1) - 1
        name = f'{_DIR}req/{n}'
        key = rt.job_keys[1] if rt.job_keys else b''
        rt.service().kv_set(name, _seal(key, name, b'{"to": []}'))
    except Exception:  # noqa: BLE001
      pass
    if self.thread is not None:
      self.thread.join(_POLL_S + 1.0)

  def _serve(self, n: int) -> None:
    rt = self.runtime
    client = rt.service()
    # Numbers answered lately, in order (bounded): a request found by a
    # catch-up scan and then again by the cursor is answered once.
    answered: dict[int, None] = {}
    while not self.stopping:
      try:
        value = client.kv_get(f'{_DIR}req/{n}', _POLL_S)
      except Exception as e:  # noqa: BLE001
        if self.stopping or not rt.connected():
          return
        if 'DEADLINE_EXCEEDED' in str(e) or 'NOT_FOUND' in str(e):
          n = self._catch_up(n, answered)
          continue
        time.sleep(_POLL_S)  # The service is unreachable; keep trying slowly.
        continue
      if n not in answered:
        self._answer(n, value, answered)
      n += 1

  def _answer(self, n: int, value: bytes, answered: dict[int, None]) -> None:
    """Answers request n (stored as `value`) if it is authentic and names this process."""
    rt = self.runtime
    me = _index(rt)
    answered[n] = None
    while len(answered) > 256:
      del answered[next(iter(answered))]
    try:
      name = f'{_DIR}req/{n}'
      key = _key(rt, _POLL_S)
      body = _unseal(key, name, value, _MAX_REQUEST)
      request = {} if body is None else json.loads(body)
      if me in request.get('to', ()):
        name = f'{_DIR}resp/{n}/{me}'
        answer = json.dumps(local_report(rt)).encode()
        if len(answer) <= _MAX_ANSWER:
          rt.service().kv_set(name, _seal(key, name, answer))
    except Exception as e:  # Never let the reporter die.  # noqa: BLE001
      rt.log.warning('multihost: could not answer where-request %d: %s',
                     n, failures.shorten(e, 200))

  def _catch_up(self, n: int, answered: dict[int, None]) -> int:
    """After an idle poll on number n: answers every pending authentic request not yet answered; returns the next number to wait on.

    Requesters take their numbers and write their requests in separate
    steps, so requests can appear out of order: number n may be written
    just after the poll gave up on it while n+1 is already there, and a
    number may be taken and never written (a requester that died, or a
    counter bumped far ahead by someone without the secret). Neither may
    leave a request unanswered or the responder waiting on a number no
    request will have.
    """
    rt = self.runtime
    try:
      pending = []
      for name, stored in rt.service().kv_dir(f'{_DIR}req/'):
        tail = name.rsplit('/', 1)[1]
        if tail.isdigit() and int(tail) not in answered:
          pending.append((int(tail), name, stored))
      if not pending:  # The usual idle poll: no job key needed.
        return n
      key = _key(rt, _POLL_S)
      authentic = sorted(number for number, name, stored in pending
                         if _unseal(key, name, stored, _MAX_REQUEST) is not None)
      stored_of = {number: stored for number, _, stored in pending}
      for number in authentic:
        self._answer(number, stored_of[number], answered)
      return max([n, *(number + 1 for number in authentic)])
    except Exception:  # noqa: BLE001
      return n


def ensure_started() -> None:
  """Starts the current runtime's responder once (see `Responder`)."""
  _runtime.current().where.ensure_started()
