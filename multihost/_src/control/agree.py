"""Control plane: the agreement every collective starts with (what each process is about to do).

Each process describes its call in a `Header` (the operation, the tree
structure, the leaf shapes and dtypes, the options every process must share,
and small payloads inline). The calls below are named for what they do:

* `agree`: one barrier proves every header equal (the fast path); when it
  does not, a full exchange returns every process's header to explain why
  (an `Agreement`).
* `agree_and_read_one`: the same, and the source's inline payload is read.
* `agree_and_gather`: the same, and every process's inline payload is read.
* `full_exchange`: every process's header, always (for calls whose headers
  differ by design, such as who is the source); one barrier and one read
  when the shared fields agree.

Every process reaches the same verdict from the same headers, so a mismatch
raises the same `ConsistencyError` everywhere before any data moves, and a
missing process raises a timeout naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib

from multihost._src.control import codec
from multihost._src.control import rendezvous
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import leaves
from multihost._src.runtime import runtime as _runtime
from multihost._src.runtime import settings as _settings

# the coordination service's key-value store (slow for bulk data, but one RPC
# away): for small payloads that beats compiling and running a device
# collective.
INLINE_BYTES = 64 * 1024

# A shard's (start, stop) per dimension of its global array.
Bounds = tuple[tuple[int, int], ...]
# assert_equal's per-leaf digest: one for a host-local leaf, (bounds, digest)
# per distinct shard for a global one.
LeafDigest = bytes | list[tuple[Bounds, bytes]]


# Not frozen: a frozen dataclass's __init__ sets each of its 15 fields
# through object.__setattr__ (2.9 us a header, against 0.5), on every
# call's fast path. Nothing changes a header once made.
@dataclasses.dataclass(slots=True)
class Header:
  """One process's description of the collective call it is making."""
  op: str
  tree: str = ''
  paths: tuple[str, ...] = ()
  specs: tuple[leaves.LeafSpec, ...] = ()
  size: int = 0  # bytes this process contributes to the data phase
  payload: bytes | None = None  # the data itself, when small
  # Compared by `agreement` (the fast path), so equal on every process:
  name: str = ''  # sync_global_devices' barrier name
  default_source: bool = False  # broadcast_one_to_all: process 0 is source
  tiled: bool = False  # process_allgather's option
  layouts: tuple[list[Bounds] | None, ...] = ()  # per leaf, every process's
  digests: tuple[LeafDigest, ...] = ()  # assert_equal: per leaf
  # Differ by process by design; only a full exchange compares them:
  is_source: bool = False  # broadcasts
  shards: tuple[list[Bounds] | None, ...] = ()  # per leaf, this process's
  seal: bytes = b''  # object collectives: nonce + MAC of the pickled bytes
  # The settings every process must share ((variable, value) pairs), in
  # the agreement: a difference is named before any data moves.
  settings: tuple[tuple[str, str], ...] = dataclasses.field(
      default_factory=_settings.shared)

  def agreement(self) -> bytes:
    """A digest of everything every process must agree on."""
    specs = [s.fields() for s in self.specs]
    # A global leaf's digests are of this process's shards, which differ by
    # process by design: the caller compares them after the exchange.
    digests = [d if isinstance(d, bytes) else None for d in self.digests]
    what = (self.op, self.tree, self.paths, tuple(specs), self.name,
            self.default_source, self.tiled, self.layouts, tuple(digests),
            self.settings)
    try:
      digest = _DIGESTS.get(what)
    except TypeError:  # (a list inside: global leaves' layouts)
      return _digest(what)
    if digest is None:
      if len(_DIGESTS) >= _DIGESTS_MAX:
        _DIGESTS.clear()
      digest = _DIGESTS[what] = _digest(what)
    return digest


# The digests of the last calls' agreements (`Header.agreement`): a
# training loop makes the same few calls, and `agreement` took 3.4 us a
# call making the digest, 1.3 looking it up (timeit). Bounded: cleared
# when full.
_DIGESTS: dict[tuple, bytes] = {}
_DIGESTS_MAX = 256


def _digest(what: tuple) -> bytes:
  # repr of plain tuples, not the wire codec or dataclass reprs: the digest
  # is only compared, never decoded, and this is deterministic and
  # cheaper (it is on every call's fast path).
  return hashlib.sha256(repr(what).encode()).digest()[:16]


@dataclasses.dataclass(frozen=True)
class Agreement:
  """What `agree` found.

  Attributes:
    agreed: every process passed an equal header (one barrier proved it).
    headers: every process's header when `agreed` is False (the caller
      explains the difference from them, or finds none); None otherwise.
  """
  agreed: bool
  headers: list[Header] | None = None


_AGREED = Agreement(agreed=True)


def agree(header: Header, *, timeout: float,
          runtime: _runtime.Runtime | None = None, eager=None,
          relay=None) -> Agreement:
  """Whether every process passed an equal header; if not, every process's header.

  Collective: every process must call this, in the same order. `runtime`
  (here and below) is the process's runtime, by default the current one.
  `eager`: a broadcast source's first stripe, sent during an agreement
  over the links (`transport.tcp.eager.Eager`); `relay`: where a process
  keeps the agreement's answer for its children, to send it on with a
  broadcast's payload (`transport.tcp.tree.Relay`).
  """
  meeting = _meet(runtime, header.op, header.name)
  if meeting.try_agreement(header.agreement(), timeout=timeout, eager=eager,
                           relay=relay):
    return _AGREED
  return Agreement(agreed=False,
                   headers=_exchange_headers(meeting, header, timeout))


def agree_and_read_one(header: Header, source: int, *, timeout: float,
                       publish: bytes | None = None,
                       runtime: _runtime.Runtime | None = None
                       ) -> tuple[bytes | None, list[Header] | None]:
  """`agree`, and on agreement what the `source` shared: its `publish`, by default its header's inline payload.

  Collective: every process must call this, in the same order. Only the
  source's `publish` is read.

  Returns:
    (what the source shared, None) when every header agreed (the source
    gets its own); else (None, every process's header).
  """
  meeting = _meet(runtime, header.op)
  mine = meeting.me == source
  if mine and publish is None:
    publish = header.payload or b''
  if meeting.try_agreement(header.agreement(), timeout=timeout,
                           publish=publish if mine else None):
    return (publish if mine else meeting.read_one(source)), None
  return None, _exchange_headers(meeting, header, timeout)


def agree_and_gather(header: Header, *, timeout: float,
                     publish: bytes | None = None,
                     runtime: _runtime.Runtime | None = None
                     ) -> tuple[list[bytes] | None, list[Header] | None]:
  """`agree`, and on agreement every process's inline payload.

  Collective: every process must call this, in the same order.

  Args:
    header: this process's call.
    timeout: seconds to wait for every process.
    publish: what this process shares on agreement (default: the header's
      payload); e.g. the few fields that differ by process by design, which
      every process then reads from the same records.

  Returns:
    (what every process shared, None) when every header agreed; else
    (None, every process's header).
  """
  meeting = _meet(runtime, header.op)
  if publish is None:
    publish = header.payload or b''
  if meeting.try_agreement(header.agreement(), timeout=timeout,
                           publish=publish):
    return meeting.read_all(), None
  return None, _exchange_headers(meeting, header, timeout)


def shared(records: list[bytes] | None, op: str) -> list[bytes]:
  """What every process shared, from `agree_and_gather` that returned no headers (then never None)."""
  if records is None:
    raise errors.MultihostError(
        f'{failures.prefix()} {op}: the agreement returned neither what '
        'every process shared nor their headers.')
  return records


def full_exchange(header: Header, *, timeout: float,
                  runtime: _runtime.Runtime | None = None) -> list[Header]:
  """Every process's header, checked to name the same operation.

  Collective: every process must call this, in the same order.

  For calls whose headers differ by design (who is the source, seals,
  sizes): every process publishes its whole header before the agreement
  barrier, so when the fields every process must share agree, one barrier
  and one read return every header; otherwise the full exchange does.
  """
  meeting = _meet(runtime, header.op)
  message = codec.encode(header)
  if meeting.try_agreement(header.agreement(), timeout=timeout,
                           publish=message):
    return _decode_headers(meeting, meeting.read_all())
  return _exchange_headers(meeting, header, timeout, message)


def _meet(runtime: _runtime.Runtime | None, op: str,
          name: str = '') -> rendezvous.Rendezvous:
  return rendezvous.Rendezvous(runtime or _runtime.current(), op,
                                        name)


def _exchange_headers(meeting: rendezvous.Rendezvous, header: Header,
                      timeout: float, message: bytes | None = None
                      ) -> list[Header]:
  if message is None:
    message = codec.encode(header)
  return _decode_headers(meeting, meeting.exchange(message, timeout=timeout))


def _decode_headers(meeting: rendezvous.Rendezvous,
                    messages: list[bytes]) -> list[Header]:
  me = meeting.me
  headers = [codec.decode(Header, m, where=(
      f'{failures.prefix(me)} {meeting.op}: process {p}')) for p, m in
             enumerate(messages)]
  ops = [h.op for h in headers]
  if len(set(ops)) > 1:
    raise failures.different_collectives(ops, me=me)
  check_same_settings(headers, me=me)
  return headers


def check_same_settings(headers: list[Header], *,
                        me: int | None = None) -> None:
  """Raises ConsistencyError, naming the variable and each process's value, unless every process has the same shared settings."""
  first = headers[0].settings
  if all(h.settings == first for h in headers[1:]):
    return
  for name in sorted({name for h in headers for name, _ in h.settings}):
    values = [dict(h.settings).get(name) for h in headers]
    if len(set(values)) > 1:
      raise errors.ConsistencyError(
          f'{failures.prefix(me)} {headers[0].op}: ${name} differs across '
          f'processes (processes {failures.minority(values)} differ from '
          f'the rest): {dict(enumerate(values))}. Set it to the same value '
          'on every process (or unset it everywhere).')


def check_same_options(headers: list[Header],
                       fields: tuple[str, ...] = ('tiled', 'layouts'), *,
                       me: int | None = None) -> None:
  """Raises ConsistencyError unless all headers agree on the call's options.

  The options are what shapes the result besides the leaves (by default
  `tiled` and the global leaves' layouts), so the full-exchange path checks
  what the fast path's digest does.
  """
  for field in fields:
    values = [getattr(h, field) for h in headers]
    if all(v == values[0] for v in values[1:]):
      continue
    differing = failures.minority([repr(v) for v in values])
    shown = (str({p: v for p, v in enumerate(values)})
             if field != 'layouts'
             else '(the global leaves are sharded differently)')
    raise errors.ConsistencyError(
        f'{failures.prefix(me)} {headers[0].op}: the option {field!r} '
        f'differs across processes (processes {differing} differ from the '
        f'rest): {shown}. Every process must pass the same options, or '
        'the processes would return results of different shapes.')


def check_same_leaves(headers: list[Header], what: str = '', *,
                      me: int | None = None) -> None:
  """Raises ConsistencyError unless all headers have the same tree and specs.

  `me` is this process's index (default: the current runtime's), for the
  message's prefix.
  """
  first = (headers[0].tree, headers[0].paths, headers[0].specs)
  if all((h.tree, h.paths, h.specs) == first for h in headers[1:]):
    return
  by_process = {p: (h.tree, h.paths, h.specs) for p, h in enumerate(headers)}
  signature = [hash((h.tree, h.paths, h.specs)) for h in headers]
  differing = failures.minority(signature)
  op = headers[0].op
  message = (f'{failures.prefix(me)} {op}: the inputs differ across '
             f'processes (processes {differing} differ from the rest): '
             f'{leaves.first_difference(by_process)}.')
  if what:
    message += ' ' + what
  raise errors.ConsistencyError(
      message + ' Every process must pass a tree of the same structure, '
      'shapes and dtypes.')
