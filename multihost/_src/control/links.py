"""Control plane: the TCP links that calls agree over, set up once every process met, and whether calls use them.

The first calls meet through the coordination service; meanwhile each
process connects to the peers of the agreement's rounds (or, in a star,
to process 0 and the broadcast tree's peers) on a thread, and records its
outcome at the service (`prepare`). After each meeting every process reads
the records written before it (`met`), so all switch to the links in the
same call once every process set them up, or all stay on the service once
one could not. The agreement over the links is `control.rounds`.

The service stays for liveness, first contact (addresses, link setup) and
diagnosis; with MULTIHOST_TRANSPORT=device (e.g. where peers cannot open
connections to each other) every call agrees through the service.
"""

from __future__ import annotations

import hmac
import threading
import time

from multihost import env as _env
from multihost._src.auth import marks as _control_marks
from multihost._src.auth import secret as _secret
from multihost._src.control import topology
from multihost._src.runtime import failures
from multihost._src.runtime import runtime
from multihost._src.runtime import settings
from multihost._src.transport.tcp import link as _tcp_link
from multihost._src.transport.tcp import threads
from multihost._src.transport.tcp import tree as _tree

# Connecting the links (on a thread) once every process met.
SETUP_S = 30.0
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
    rt.service().kv_set(key, _control_marks.mac(secret, key, value) + value)
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
  for key, stored in rt.service().kv_dir(_RECORDS):
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
    plane.one_host = (records is not None and hosts is not None
                      and len(set(hosts)) == 1
                      and all(local for _, local in records))
    plane.spare_cores = hosts is not None and threads.cores() > hosts.count(
        hosts[rt.index])
    peers = {p for pair in topology.steps(rt.index, rt.count, plane.star)
             for p in pair if p is not None}
    if plane.star:  # (and the tree's, for broadcasts' answers: `rounds`)
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
