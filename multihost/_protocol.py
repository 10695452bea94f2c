"""The agreement step every collective starts with.

Each process publishes a `Header` (the operation, the tree structure, the leaf
shapes and dtypes, and small payloads inline) through `_exchange`; every
process then reads all headers and reaches the same verdict, so a mismatch
raises the same `ConsistencyError` on every process before any device
collective starts, and a missing process raises a timeout naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from typing import Any

from multihost import _errors
from multihost import _exchange
from multihost import _leaves
from multihost import _runtime

# Payloads up to this many bytes per process travel inside the header, through
# the coordination service's key-value store (about 45 MB/s, ~0.2 ms per RPC):
# for small payloads that beats compiling and running a device collective.
INLINE_BYTES = 64 * 1024


@dataclasses.dataclass
class Header:
  op: str
  tree: str = ''
  paths: tuple[str, ...] = ()
  specs: tuple[_leaves.LeafSpec, ...] = ()
  extra: dict[str, Any] = dataclasses.field(default_factory=dict)
  size: int = 0  # bytes this process contributes to the data phase
  payload: bytes | None = None  # the data itself, when small
  agreed: Any = None  # what else must be equal everywhere (a name, digests)

  def agreement(self) -> bytes:
    """A digest of everything every process must agree on."""
    what = (self.op, self.tree, self.paths, self.specs, self.agreed)
    return hashlib.sha256(
        pickle.dumps(what, protocol=pickle.HIGHEST_PROTOCOL)).digest()[:16]


def exchange(header: Header, *, timeout: float, fast: bool = False,
             publish: bool = True, read: bool | int = True
             ) -> tuple[list[Header | None] | None, bool]:
  """Meets every process with `header`; returns (headers, proven_equal).

  Collective: every process must call this, in the same order.

  With `fast`, it first tries one barrier that completes only if every
  process's header agrees (`Header.agreement`); then `proven_equal` is True,
  and `headers` is None unless `read` (then it holds the headers of the
  processes that `publish`ed, None for the others). Otherwise (or after the
  fast path fell back) it returns every process's header, already checked to
  name the same operation, and `proven_equal` is False.
  """
  # On the fast path everything but the payload is proven equal, so only the
  # payload travels; the full header goes only into the full exchange.
  messages, agreed = _exchange.rendezvous(
      header.op, lambda: pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL),
      timeout=timeout, agreement=header.agreement() if fast else None,
      publish=publish, read=read,
      fast_message=header.payload or b'' if fast else None)
  if messages is None:
    return None, True
  if agreed:
    return [None if m is None else dataclasses.replace(header, payload=m)
            for m in messages], True
  headers = [pickle.loads(m) for m in messages]
  ops = [h.op for h in headers]
  if len(set(ops)) > 1:
    raise _errors.ConsistencyError(
        f'{_runtime.log_prefix()} processes called different collectives at '
        f'the same point: {groups(ops)}. Every process must call the same '
        'multihost collectives in the same order.')
  return headers, False


def check_same_leaves(headers: list[Header], what: str = '') -> None:
  """Raises ConsistencyError unless all headers have the same tree and specs."""
  first = (headers[0].tree, headers[0].paths, headers[0].specs)
  if all((h.tree, h.paths, h.specs) == first for h in headers[1:]):
    return
  by_process = {p: (h.tree, h.paths, h.specs) for p, h in enumerate(headers)}
  signature = [hash((h.tree, h.paths, h.specs)) for h in headers]
  differing = _minority(signature)
  op = headers[0].op
  message = (f'{_runtime.log_prefix()} {op}: the inputs differ across '
             f'processes (processes {differing} differ from the rest): '
             f'{_leaves.first_difference(by_process)}.')
  if what:
    message += ' ' + what
  raise _errors.ConsistencyError(
      message + ' Every process must pass a tree of the same structure, '
      'shapes and dtypes.')


def _minority(values: list) -> list[int]:
  """Processes whose value is not the most common one (ties: not process 0's)."""
  counts: dict = {}
  for v in values:
    counts[v] = counts.get(v, 0) + 1
  majority = max(counts, key=lambda v: (counts[v], v == values[0]))
  return [p for p, v in enumerate(values) if v != majority]


def groups(values: list, render=repr) -> str:
  """'processes [0, 2] have 'a'; process [1] has 'b'' for per-process values."""
  by_value: dict = {}
  for p, v in enumerate(values):
    by_value.setdefault(v, []).append(p)
  parts = []
  for v, ps in by_value.items():
    noun = 'process' if len(ps) == 1 else 'processes'
    parts.append(f'{noun} {ps}: {render(v)}')
  return '; '.join(parts)
