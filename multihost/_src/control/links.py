"""Control plane: the agreement over the authenticated TCP links, in ceil(log2 P) dissemination rounds (or, on one host, a star).

Once the links are up (`met`: after the first calls, which meet through
the coordination service), a call's agreement travels over them: in round k
process i sends to (i + 2^k) mod P and receives from (i - 2^k) mod P. Each
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

The service stays for liveness, first contact (addresses, link setup) and
diagnosis; with MULTIHOST_TRANSPORT=device (e.g. where peers cannot open
connections to each other) every call agrees through the service.
"""

from __future__ import annotations

import hmac
import struct
import threading
import time

from multihost import env as _env
from multihost._src.auth import marks as _control_marks
from multihost._src.auth import secret as _secret
from multihost._src.control import topology
from multihost._src.control import waiting
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import runtime
from multihost._src.runtime import settings
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
# Connecting the links (on a thread) once every process met.
SETUP_S = 30.0
# digest, flags, relays, the smallest timeout the sender knows of, entries
_HEAD = struct.Struct('<16sBBdI')
_ENTRY = struct.Struct('<II')  # process, length
_DIFFERS = 1
# In a star, "relays": in a process's frame to process 0, whether it takes
# its answer from its parent in the tree (`topology.answered_by`); in an
# answer, those processes, one bit each (bit p for process p; a star has
# at most `topology.STAR_MAX`).
_RELAYED = 1
# At most this many processes read every process's address record at the
# links' setup (for the star, and for `Plane.spare_cores`).
HOSTS_READ_MAX = 64
# Each process's link-setup outcome: 'call|ok' or 'call|failed', MAC'd.
_RECORDS = 'multihost/links/'

def service_only(rt: runtime.Runtime) -> None:
  """Makes `rt`'s calls agree through the service only (tests of that path)."""
  rt.service_only = True


def enabled(rt: runtime.Runtime) -> bool:
  """Whether `rt`'s calls will agree over the links (TCP transport)."""
  return (not rt.service_only and rt.count > 1
          and settings.transport() in (None, 'tcp'))


usable = _tcp_link.agreeing


def prepare(rt: runtime.Runtime, op: str, call: int) -> None:
  """Before meeting through the service in `call`: listens (its address published), and records a finished link setup."""
  plane = _tcp_link.plane_of(rt, op, time.monotonic() + SETUP_S)
  if plane.setup in ('ok', 'failed'):
    key = _RECORDS + str(rt.index)
    value = f'{call}|{plane.setup}'.encode()
    secret = _secret.job_secret(op, timeout=SETUP_S, runtime=rt)
    rt.client.kv_set(key, _control_marks.mac(secret, key, value) + value)
    plane.setup = 'recorded'


def met(rt: runtime.Runtime, op: str, call: int) -> None:
  """After every process met through the service in `call`: sets the links up, or switches to them.

  Collective: every process calls this after the same calls. The setup
  (connecting to the rounds' peers) runs on a thread; each process records
  its outcome before a later meeting (`prepare`), and after each meeting
  every process reads the records written before it, so all see the same
  ones: all switch to the links in the same call once every process set
  them up, or all stay on the service once one could not.
  """
  plane = rt.plane
  if plane is None or plane.agrees or plane.refused:
    return
  if plane.setup is None:
    plane.setup = 'running'
    threading.Thread(target=_setup, args=(rt, plane, op), daemon=True,
                     name='multihost-links-setup').start()
  secret = _secret.job_secret(op, timeout=SETUP_S, runtime=rt)
  keys = {_RECORDS + str(p) for p in range(rt.count)}
  states = []
  for key, stored in rt.client.kv_dir(_RECORDS):
    value = stored[_control_marks.MAC:]
    if key not in keys or not hmac.compare_digest(
        stored[:_control_marks.MAC], _control_marks.mac(secret, key, value)):
      continue  # planted: it changes nothing
    written, _, state = value.decode().partition('|')
    if int(written) <= call:
      states.append(state)
  if 'failed' in states:
    plane.refused = True
    rt.log.warning(
        'the links between the processes could not all be set up (%s); '
        'calls agree through the coordination service. Open TCP between '
        'the hosts on the ports the processes publish, or set %s=device.',
        plane.setup_error or 'a peer could not connect', _env.TRANSPORT)
  elif len(states) == rt.count:
    plane.agrees = True


def _setup(rt: runtime.Runtime, plane: _tcp_link.Plane, op: str) -> None:
  """Opens the links of the rounds (on the setup thread)."""
  deadline = time.monotonic() + SETUP_S
  try:
    # Every process's host, from the address records (one read each, so
    # only for a job of at most HOSTS_READ_MAX processes).
    records = (plane.host_records(op, deadline)
               if rt.count <= HOSTS_READ_MAX else None)
    hosts = None if records is None else [host for host, _ in records]
    plane.star = topology.star(rt, hosts)
    plane.one_host = (hosts is not None and len(set(hosts)) == 1
                      and all(local for _, local in records))
    plane.spare_cores = hosts is not None and threads.cores() > hosts.count(
        hosts[rt.index])
    peers = {p for pair in topology.steps(rt.index, rt.count, plane.star)
             for p in pair if p is not None}
    if plane.star:  # (and the tree's, for broadcasts' answers: `agree`)
      parent, children = _tree.tree_peers(rt.index, rt.count)
      peers.update(children if parent is None else [parent, *children])
    # Connect first, then await the lower-numbered peers' connections: a
    # connection needs only the acceptor's listener thread, so none waits.
    for peer in sorted(peers, key=lambda p: (p < rt.index, p)):
      plane.conn(peer, deadline, op)
  except Exception as e:  # noqa: BLE001  Recorded; the service path stays.
    plane.setup_error = failures.shorten(e, 200)
    plane.setup = 'failed'
    return
  plane.setup = 'ok'


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
  rt, op, me, count = meeting.rt, meeting.op, meeting.me, meeting.count
  met_start = rt.met_start
  last_end = rt.last_end
  if last_end is None or meeting.start - last_end > waiting.WINDOW_S:
    # Come late: the others may have given the call up.
    waiting.late(meeting, timeout)
  plane = rt.plane
  call = meeting.call | AGREE_BIT
  entries = {} if publish is None else {me: publish}
  differs = False
  smallest = timeout  # the smallest timeout of the processes heard from
  wait = waiting.Wait(meeting, timeout)
  watch = waiting.Due(wait)
  reads = waiting.Due(wait, idle=wait.slice)  # (see `_receive`)
  sender = None
  links: dict[int, _tcp_link.Link] = {}  # this call's, by peer
  peer = me
  step = 1
  started = None  # the eager stripe this process started
  everything = None  # in a star, all of `entries` encoded (see below)
  try:
    star = plane.star
    relayed = star and relay is not None
    # The eager stripe goes right behind this process's frame to the peer
    # its transfer sends to first.
    to = chain.first_peer(plane, eager.length) if eager is not None else None
    # A relayed broadcast's data frame may come as the answer (`_receive`).
    data = _tcp_link.transfer_id(plane) if relayed and me else None
    relays = 0  # in a star, the processes answered by their parent
    same = True  # every timeout heard of is this process's own
    answer = b''  # in a star, the answer as this process received it
    steps = topology.steps(me, count, star, relayed)
    answered = not star  # (a star's answers follow what came: `answers`)
    at = 0
    while at < len(steps):
      dst, src = steps[at]
      at += 1
      if dst is not None:
        peer = dst
        out = links.get(dst) or links.setdefault(
            dst, plane.conn(dst, wait.deadline, op, idle=wait.slice))
        if star and me and dst:  # The answer, passed on as it came.
          body = answer
        elif star and me:  # This process's frame to process 0.
          body = _encode(digest, 0, smallest, entries,
                         _RELAYED if relayed else 0)
        elif star and dst not in entries:
          # What `dst` does not know yet: everything, or everything but
          # its own (one message for all that published nothing, and
          # all that the answer's relays pass on, encoded once).
          body = everything = everything or _encode(
              digest, _DIFFERS if differs else 0, smallest, entries, relays)
        else:
          body = {p: v for p, v in entries.items()
                  if (p != dst if star else (dst - p) % count >= step)}
          body = _encode(digest, _DIFFERS if differs else 0, smallest, body,
                         relays)
        sockets.set_timeout(out.sock, sockets.SLICE_S)
        if len(body) <= threads.DIRECT_BYTES and sender is None:
          sockets.send_all(out.sock, out.frame(call, len(body)) + body, watch)
          if (eager is not None and started is None and not differs
              and dst == to):  # Right behind its frame.
            started = eager
            eager.start(plane, out, dst)
        else:  # Large: on a thread, so that rounds that all send never block.
          sender = sender or plane.sends.sender(watch)
          sender.send(out.sock, out.frame(call, len(body)) + body)
      if src is not None:
        peer = src
        link = links.get(src)
        if link is None:  # (at 2 processes the peer sent to is this one)
          link = links[src] = plane.conn(src, wait.deadline, op,
                                         idle=wait.slice)
          sockets.set_timeout(link.sock, sockets.SLICE_S)
        body = _receive(link, call, src, wait, reads, data)
        if isinstance(body, int):
          # The payload's frame: every process agreed, with the same
          # timeout (process 0 sends no answer otherwise).
          relay.folded = body
        else:
          got_digest, got_flags, got_relays, got_timeout, got = _decode(
              body, count)
          differs = (differs or bool(got_flags & _DIFFERS)
                     or got_digest != digest)
          same = same and got_timeout == timeout
          smallest = min(smallest, got_timeout)
          entries.update(got)
          everything = None
          if me:
            answer, relays = body, got_relays
          elif got_relays:
            relays |= 1 << src
      if not answered and at == len(steps):
        # Every frame this process waits for came: whom it answers.
        answered = True
        if (me == 0 and relayed and not differs and same
            and relays == (1 << count) - 2):
          # A relayed broadcast that every process agreed, with the same
          # timeout: the payload's frames are the answers (`tcp.tree`).
          if eager is not None:  # (its link came in `links` above)
            started = eager
            eager.start(plane, links[to], to)
        elif me == 0 or relay is None or relay.folded is None:
          steps += [(p, None) for p in topology.answers(me, count, relays, to)]
      step *= 2
    if sender is not None:
      peer, done, sender = me, sender, None
      done.close(wait.deadline)
    now = time.monotonic()
    if not differs and (met_start is None or now - met_start
                        >= smallest - waiting.slack(smallest)):
      # Completed late enough that another process's deadline may have
      # passed: the call's outcome record decides (see the module notes).
      peer = me
      decided, by = _control_marks.settle(rt, op, meeting.prefix,
                                          _control_marks.DONE)
      meeting.wrote()
      if decided != _control_marks.DONE:
        raise failures.given_up_elsewhere(
            op, me=me, by=by, waited=now - meeting.start, timeout=timeout,
            source=rt.timeout_source(timeout))
    if differs and started is not None:
      # The rest of the stripe goes before the link's next frame, and the
      # next process drops it (or reads it, if the call goes on to a
      # transfer): neither waits for the other here, so both go on to the
      # full exchange that names the difference.
      started.defer()
  except (errors.CollectiveTimeoutError, errors.ProcessFailureError) as e:
    if sender is not None:
      sender.finish(time.monotonic() + 0.1)
    if started is not None and isinstance(e, errors.CollectiveTimeoutError):
      # The rest of the frame follows; every other process raises too (the
      # outcome record), and drops it in its next agreement.
      started.defer()
    elif started is not None:
      _tcp_link.break_plane(plane, e)  # A data frame is cut short.
    raise
  except (OSError, TimeoutError, ValueError, struct.error,
          errors.MultihostError) as e:
    if sender is not None:
      sender.finish(time.monotonic() + 0.1)
    _tcp_link.break_plane(plane, e)
    if isinstance(e, (ValueError, struct.error)):
      e = failures.forged_frame(op, peer, f'held no agreement ({e})')
    raise tcp_errors.peer_error(op, peer, e, rt.watchdog) from e
  finally:
    wait.end()
  return None if differs else entries
