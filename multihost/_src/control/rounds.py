"""Control plane: one call's agreement over the authenticated TCP links, in ceil(log2 P) dissemination rounds (or, on one host, a star).

Once the links are up (`control.links`: after the first calls, which meet
through the coordination service), a call's agreement travels over them:
in round k process i sends to (i + 2^k) mod P and receives from
(i - 2^k) mod P. Each
message carries the call id (in its frame header, MAC'd with the link's
frame number, so forged, replayed or reordered frames are refused), the
16-byte digest of the sender's header, a flag that says a difference was
seen, and the small payloads the sender knows that the receiver does not.
After the last round every process has every payload, and the flag is set
on every process exactly when two digests differ (round k's flag covers the
2^(k+1) processes before the receiver, joined by the receiver's own
comparison), so every process reaches the same verdict: agreement, with the
payloads (no second phase), or a difference, which the coordination
service's full exchange then explains (ConsistencyError everywhere).
When 3 to 8 processes all publish one host with no more cores than
processes (`topology.star`, decided alike by every process from the same address
records at the links' setup and the host's core count), the
same messages go in a star instead: each process sends its to process 0,
which compares them all and answers each with the verdict, the smallest
timeout and the payloads it lacks: 2(P-1) messages a call instead of
P log2 P, on cores the processes share. A default-source broadcast whose
payload goes down the binomial tree next (`tcp.tree.Relay`) takes the
answers down that tree instead: each process says in its frame that it
takes its answer from its parent there; process 0 answers only its own
children and every process that did not say so, and each process passes
the answer on to its children that did (so a difference reaches every
process whatever each one's call was). When every process agreed with the
same timeout no answer is sent at all: the payload's frame from the
parent is the answer.

A process never leaves the rounds alone on a slow peer: a process that
completes knows every process started the call, and every process that
started sends all its rounds, so either all complete or none does, but for
a timeout. A process whose deadline passes may have sent every frame the
others need (a latecomer came just then): they would complete while it
raised. So a timeout is settled in the call's outcome record at the
service (`auth.marks.settle`, created atomically, first writer decides): a
process at its deadline settles "given up", and a process that completes
late enough that another's deadline may have passed settles "done" before
it returns. Whoever comes second follows the record: a completed process
raises (`failures.given_up_elsewhere`), and a process at its deadline
waits on for frames that are on their way (every process arrived). "Late
enough": no process starts call c before this process started call c - 1
(`Runtime.met_start`: that call needed it), so another's deadline cannot
pass before met_start + the smallest timeout (carried in every frame);
completing within `waiting.slack` of that costs one RPC, earlier costs nothing.
That leaves one order uncovered: a process completes more than the slack
before another's deadline, and that other's last frame takes longer than
the slack to reach it (a peer hung in the middle of the rounds). Calls
spaced by less than three quarters of their timeout never touch the record.

What the service's fast window did becomes diagnosis: after `waiting.WINDOW_S` a waiting
process publishes its presence beside the call (so a timeout names who is
missing, and where), arms the stall report, and looks for gave-up marks (a
latecomer then raises at once, as on the service path). At the timeout it
raises the named CollectiveTimeoutError and leaves its own mark. Frames of
an older call (a latecomer's, after the others gave up) are discarded.
"""

from __future__ import annotations

import struct
import time

from multihost._src.auth import marks as _control_marks
from multihost._src.control import topology
from multihost._src.control import waiting
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.transport.tcp import chain
from multihost._src.transport.tcp import eager as _eager
from multihost._src.transport.tcp import errors as tcp_errors
from multihost._src.transport.tcp import frames
from multihost._src.transport.tcp import link as _tcp_link
from multihost._src.transport.tcp import payload
from multihost._src.transport.tcp import sockets
from multihost._src.transport.tcp import threads
from multihost._src.transport.tcp import tree as _tree

# Agreement frames have this bit set in their call field; data frames count
# transfers (`Plane.seq`) and never reach it.
AGREE_BIT = 1 << 63
# digest, flags, relays, the smallest timeout the sender knows of, entries
_HEAD = struct.Struct('<16sBBdI')
_ENTRY = struct.Struct('<II')  # process, length
_DIFFERS = 1
# In a star, "relays": in a process's frame to process 0, whether it takes
# its answer from its parent in the tree (`topology.answered_by`); in an
# answer, those processes, one bit each (bit p for process p; a star has
# at most `topology.STAR_MAX`).
_RELAYED = 1


def _encode(digest: bytes, flags: int, timeout: float,
            entries: dict[int, bytes], relays: int = 0) -> bytes:
  parts = [_HEAD.pack(digest, flags, relays, timeout, len(entries))]
  for p, value in entries.items():
    parts.append(_ENTRY.pack(p, len(value)))
    parts.append(value)
  return b''.join(parts)


def _decode(body: bytes, count: int
            ) -> tuple[bytes, int, int, float, dict[int, bytes]]:
  digest, flags, relays, timeout, n = _HEAD.unpack_from(body)
  at = _HEAD.size
  entries = {}
  for _ in range(n):
    p, length = _ENTRY.unpack_from(body, at)
    at += _ENTRY.size
    if p >= count or at + length > len(body):
      raise ValueError(f'entry of process {p} ({length} bytes) out of range')
    entries[p] = body[at:at + length]
    at += length
  if at != len(body):
    raise ValueError(f'{len(body) - at} bytes after the entries')
  return digest, flags, relays, timeout, entries


def _receive(link: _tcp_link.Link, call: int, peer: int,
             wait: waiting.Wait, deadline: waiting.Due,
             data: int | None = None) -> bytes | int:
  """The body of `peer`'s agreement frame for `call`; older calls' frames are discarded.

  With `data` (a relayed broadcast's transfer id, `tcp.tree.Relay`), the
  header of that transfer's data frame may come instead: it is the
  answer that every process agreed, and its length is returned (the
  payload is the transfer's to read).

  `deadline` (one for all the call's reads) has the wait's diagnosis as
  its idle step: while nothing of a frame has come, it runs between the
  socket's slices (`waiting.Wait.slice`); once part of it came, its peer
  is in this call, and only the watchdog and the deadline are checked.
  """
  m = wait.m
  while True:
    got_call, length = link.check(link.take(frames.FRAME_SIZE, deadline),
                                  m.op, peer)
    if not got_call & AGREE_BIT:
      if got_call == data:
        return length
      # Data where an agreement frame is due: the stripe a source sent
      # with its agreement frame of a call this process gave up, or came
      # too late to (`tcp.eager.Eager`).
      payload.drop(link, length, waiting.Due(wait))
      continue
    body = link.take(length, deadline)
    if got_call < call:
      continue  # A frame of a call this process gave up (a latecomer's).
    if got_call != call:
      raise failures.out_of_step(m.op, peer, (got_call, length),
                                     (call, length))
    return body


def agree(meeting, digest: bytes, publish: bytes | None, *,
          timeout: float, eager: _eager.Eager | None = None,
          relay: _tree.Relay | None = None) -> dict[int, bytes] | None:
  """Every process's published bytes (by process) when every digest equals `digest`; None when any differs.

  Collective: every process must call this, in the same order. `meeting`
  is the call's `Rendezvous`. A broadcast's source passes its `eager`
  first stripe, started right after its frame to the process its transfer
  sends to first (in a star: its answer to that process, sent before the
  others once every process agreed, or with a `relay` that answer itself;
  see `transport.tcp.eager.Eager`); on a difference or a timeout its link
  owes the rest, and that process drops it (`_receive`) unless the call
  goes on to its transfer. Every process of a default-source broadcast
  down the tree passes its `relay` (`transport.tcp.tree.Relay`; in a star
  only: the answers take the tree's path).

  Raises:
    CollectiveTimeoutError: a process did not arrive in time (named).
    ProcessFailureError: a peer is gone.
    MultihostError: a forged or out-of-step frame (the links are closed).
  """
  rt = meeting.rt
  last_end = rt.last_end
  if last_end is None or meeting.start - last_end > waiting.WINDOW_S:
    # Come late: the others may have given the call up.
    waiting.late(meeting, timeout)
  call = _Call(meeting, digest, publish, timeout, eager, relay)
  try:
    call.run()
  except (errors.CollectiveTimeoutError, errors.ProcessFailureError) as e:
    call.stopped(e)
    raise
  except (OSError, TimeoutError, ValueError, struct.error,
          errors.MultihostError) as e:
    cause = call.broken(e)
    raise tcp_errors.peer_error(meeting.op, call.peer, cause,
                                rt.watchdog) from cause
  finally:
    call.wait.end()
  return None if call.differs else call.entries


class _Call:
  """One process's side of one call's agreement: its steps, what it heard, and whom it answers."""

  def __init__(self, meeting, digest: bytes, publish: bytes | None,
               timeout: float, eager: _eager.Eager | None,
               relay: _tree.Relay | None):
    rt = meeting.rt
    self.meeting, self.digest, self.timeout = meeting, digest, timeout
    self.eager, self.relay = eager, relay
    self.rt, self.op = rt, meeting.op
    self.me, self.count = meeting.me, meeting.count
    self.met_start = rt.met_start
    self.plane = rt.plane
    self.call = meeting.call | AGREE_BIT
    self.entries = {} if publish is None else {self.me: publish}
    self.differs = False
    self.smallest = timeout  # the smallest timeout of the processes heard from
    self.wait = waiting.Wait(meeting, timeout)
    self.watch = waiting.Due(self.wait)
    self.reads = waiting.Due(self.wait, idle=self.wait.slice)  # (`_receive`)
    self.sender: threads.Sender | None = None
    self.links: dict[int, _tcp_link.Link] = {}  # this call's, by peer
    self.peer = self.me  # the peer of the step under way (named in errors)
    self.step = 1
    self.started: _eager.Eager | None = None  # the eager stripe it started
    # In a star, all of `entries` encoded (`_body`).
    self.everything: bytes | None = None
    self.relays = 0  # in a star, the processes answered by their parent
    self.same = True  # every timeout heard of is this process's own
    self.answer = b''  # in a star, the answer as this process received it

  def run(self) -> None:
    """Sends and receives every step's frame; settles a late completion."""
    plane, me, eager = self.plane, self.me, self.eager
    self.star = star = plane.star
    self.relayed = relayed = star and self.relay is not None
    # The eager stripe goes right behind this process's frame to the peer
    # its transfer sends to first.
    self.to = (chain.first_peer(plane, eager.length) if eager is not None
               else None)
    # A relayed broadcast's data frame may come as the answer (`_receive`).
    self.data = _tcp_link.transfer_id(plane) if relayed and me else None
    self.steps = topology.steps(me, self.count, star, relayed)
    answered = not star  # (a star's answers follow what came: `_answers`)
    at = 0
    while at < len(self.steps):
      dst, src = self.steps[at]
      at += 1
      if dst is not None:
        self._send(dst)
      if src is not None:
        self._take(src)
      if not answered and at == len(self.steps):
        # Every frame this process waits for came: whom it answers.
        answered = True
        self._answers()
      self.step *= 2
    if self.sender is not None:
      self.peer, done, self.sender = me, self.sender, None
      done.close(self.wait.deadline)
    self._settle()
    if self.differs and self.started is not None:
      # The rest of the stripe goes before the link's next frame, and the
      # next process drops it (or reads it, if the call goes on to a
      # transfer): neither waits for the other here, so both go on to the
      # full exchange that names the difference.
      self.started.defer()

  def _body(self, dst: int) -> bytes:
    """This process's frame body to `dst` in this step."""
    star, me = self.star, self.me
    flags = _DIFFERS if self.differs else 0
    if star and me and dst:  # The answer, passed on as it came.
      return self.answer
    if star and me:  # This process's frame to process 0.
      return _encode(self.digest, 0, self.smallest, self.entries,
                     _RELAYED if self.relayed else 0)
    if star and dst not in self.entries:
      # What `dst` does not know yet: everything, or everything but
      # its own (one message for all that published nothing, and
      # all that the answer's relays pass on, encoded once).
      if self.everything is None:
        self.everything = _encode(
            self.digest, flags, self.smallest, self.entries, self.relays)
      return self.everything
    count, step = self.count, self.step
    body = {p: v for p, v in self.entries.items()
            if (p != dst if star else (dst - p) % count >= step)}
    return _encode(self.digest, flags, self.smallest, body, self.relays)

  def _send(self, dst: int) -> None:
    """Sends this step's frame to `dst` (a large one on a thread)."""
    self.peer = dst
    plane, wait, eager = self.plane, self.wait, self.eager
    out = self.links.get(dst) or self.links.setdefault(
        dst, plane.conn(dst, wait.deadline, self.op, idle=wait.slice))
    body = self._body(dst)
    sockets.set_timeout(out.sock, sockets.SLICE_S)
    if len(body) <= threads.DIRECT_BYTES and self.sender is None:
      sockets.send_all(out.sock, out.frame(self.call, len(body)) + body,
                       self.watch)
      if (eager is not None and self.started is None and not self.differs
          and dst == self.to):  # Right behind its frame.
        self.started = eager
        eager.start(plane, out, dst)
    else:  # Large: on a thread, so that rounds that all send never block.
      self.sender = self.sender or plane.sends.sender(self.watch)
      self.sender.send(out.sock, out.frame(self.call, len(body)) + body)

  def _take(self, src: int) -> None:
    """Receives this step's frame from `src` and folds in what it says."""
    self.peer = src
    wait = self.wait
    link = self.links.get(src)
    if link is None:  # (at 2 processes the peer sent to is this one)
      link = self.links[src] = self.plane.conn(src, wait.deadline, self.op,
                                               idle=wait.slice)
      sockets.set_timeout(link.sock, sockets.SLICE_S)
    body = _receive(link, self.call, src, wait, self.reads, self.data)
    if isinstance(body, int):
      # The payload's frame: every process agreed, with the same
      # timeout (process 0 sends no answer otherwise). Such a frame is
      # read only where a relay was given (`self.data`).
      if self.relay is None:
        raise errors.MultihostError(
            f'{self.op}: process {self.me} read a payload frame without a '
            'relay to keep it in.')
      self.relay.folded = body
      return
    got_digest, got_flags, got_relays, got_timeout, got = _decode(
        body, self.count)
    self.differs = (self.differs or bool(got_flags & _DIFFERS)
                    or got_digest != self.digest)
    self.same = self.same and got_timeout == self.timeout
    self.smallest = min(self.smallest, got_timeout)
    self.entries.update(got)
    self.everything = None
    if self.me:
      self.answer, self.relays = body, got_relays
    elif got_relays:
      self.relays |= 1 << src

  def _answers(self) -> None:
    """In a star, once every awaited frame came: adds the answers this process sends."""
    me, count, relay, eager = self.me, self.count, self.relay, self.eager
    if (me == 0 and self.relayed and not self.differs and self.same
        and self.relays == (1 << count) - 2):
      # A relayed broadcast that every process agreed, with the same
      # timeout: the payload's frames are the answers (`tcp.tree`).
      # (its link came in `links` above; `to` is set with `eager`)
      if eager is not None and self.to is not None:
        self.started = eager
        eager.start(self.plane, self.links[self.to], self.to)
    elif me == 0 or relay is None or relay.folded is None:
      self.steps += [(p, None)
                     for p in topology.answers(me, count, self.relays,
                                               self.to)]

  def _settle(self) -> None:
    """Completed late enough that another process's deadline may have passed: the call's outcome record decides (see the module notes)."""
    now = time.monotonic()
    met_start, smallest = self.met_start, self.smallest
    if self.differs or not (met_start is None or now - met_start
                            >= smallest - waiting.slack(smallest)):
      return
    self.peer = self.me
    meeting = self.meeting
    decided, by = _control_marks.settle(self.rt, self.op, meeting.prefix,
                                        _control_marks.DONE)
    meeting.wrote()
    if decided != _control_marks.DONE:
      raise failures.given_up_elsewhere(
          self.op, me=self.me, by=by, waited=now - meeting.start,
          timeout=self.timeout, source=self.rt.timeout_source(self.timeout))

  def stopped(self, e: Exception) -> None:
    """On a timeout or a lost peer: stops the sends; the eager stripe's rest follows, or its link breaks."""
    if self.sender is not None:
      self.sender.finish(time.monotonic() + 0.1)
    if self.started is not None and isinstance(
        e, errors.CollectiveTimeoutError):
      # The rest of the frame follows; every other process raises too (the
      # outcome record), and drops it in its next agreement.
      self.started.defer()
    elif self.started is not None:
      _tcp_link.break_plane(self.plane, e)  # A data frame is cut short.

  def broken(self, e: Exception) -> Exception:
    """On a broken link or a bad frame: stops the sends, breaks the links; the error to name (a bad frame's is a forgery)."""
    if self.sender is not None:
      self.sender.finish(time.monotonic() + 0.1)
    _tcp_link.break_plane(self.plane, e)
    if isinstance(e, (ValueError, struct.error)):
      return failures.forged_frame(self.op, self.peer,
                                   f'held no agreement ({e})')
    return e
