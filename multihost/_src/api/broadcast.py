"""Public collectives: broadcast_one_to_all and broadcast_object."""

from __future__ import annotations

from typing import Any

import numpy as np

from multihost._src.api import objects
from multihost._src.control import agree
from multihost._src.diagnostics import metrics
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import leaves as _leaves
from multihost._src.runtime import process
from multihost._src.runtime import runtime
from multihost._src.transport import choice

# it is the source (then its inline data follows).
_SOURCE = b'\x01'
_NOT_SOURCE = b'\x00'

PyTree = Any


@metrics.recorded('broadcast_one_to_all', metrics.result_bytes)
def broadcast_one_to_all(in_tree: PyTree, is_source: bool | None = None, *,
                         timeout: float | None = None) -> PyTree:
  """Returns the source process's `in_tree` on every process.

  Collective: every process must call this, in the same order.

  Drop-in for `jax.experimental.multihost_utils.broadcast_one_to_all`: the
  result is a pytree of numpy arrays (typed PRNG key leaves come back as key
  arrays), with the dtypes JAX would give on a device. Unlike JAX, it checks
  that exactly one process is the source, and that every process passes the
  same tree structure, shapes and dtypes, before moving any data; it moves
  the whole tree as one packed transfer.

  Args:
    in_tree: pytree of arrays and scalars; same structure, shapes and dtypes
      on every process.
    is_source: whether this process is the source. Default: process 0 is.
    timeout: seconds to wait for every process (default: the process-wide
      default, see `multihost.set_default_timeout`).

  Returns:
    The source's tree, on every process.

  Raises:
    ConsistencyError: no source, several sources, or different trees.
    CollectiveTimeoutError: a process did not arrive in time (named).
  """
  op = 'broadcast_one_to_all'
  rt = runtime.current()
  timeout = rt.resolve_timeout(timeout)
  default_source = is_source is None
  if default_source:
    is_source = rt.index == 0
  tree = _leaves.host_leaves(in_tree, op)
  if tree.global_paths:
    raise ValueError(
        f'{op}: leaves {tree.global_paths} are global jax.Arrays that are '
        'not fully addressable; they are already shared by all processes. '
        'Broadcast host-local values, or use process_allgather(..., '
        'tiled=True) to get the full value of a global array.')
  values, specs, treedef = tree.values, tree.specs, tree.treedef
  if rt.count == 1:
    if not is_source:
      raise errors.ConsistencyError(
          f'{op}: no process is the source (the only process passed '
          'is_source=False). Pass is_source=True on exactly one process.')
    return treedef.unflatten(
        [_leaves.finish(v.copy(), s) for v, s in zip(values, specs, strict=True)])
  size = sum(v.nbytes for v in values)
  # The size follows from the specs, which every process checks are equal.
  inline = (size <= agree.INLINE_BYTES
            and not choice.carries_small_payloads())
  header = agree.Header(
      op, tree.signature, tree.paths, specs, size=size,
      payload=_leaves.packed_bytes(values) if is_source and inline else None,
      default_source=default_source, is_source=bool(is_source))
  # With the default source every process knows who it is, so one barrier
  # can prove agreement. With explicit is_source every process also shares
  # whether it is the source (the source its inline data), and all count
  # the sources from the same records.
  payload = None
  source = 0
  eager = relay = None
  if not default_source:
    records, headers = agree.agree_and_gather(
        header, timeout=timeout, runtime=rt,
        publish=(_SOURCE + (header.payload or b'')) if is_source
        else _NOT_SOURCE)
    if records is not None:
      source = _one_source([r[:1] == _SOURCE for r in records], op)
      payload = records[source][1:] if inline else None
  elif inline:
    payload, headers = agree.agree_and_read_one(header, 0, timeout=timeout,
                                                runtime=rt)
  else:
    # The source's bytes start down the chain with its agreement frame:
    # every process knows process 0 is the source.
    eager = choice.early_stripe(values, size) if is_source else None
    relay = choice.relay(size)
    headers = agree.agree(header, timeout=timeout, eager=eager,
                          relay=relay, runtime=rt).headers
  if headers is not None:
    source = _one_source([h.is_source for h in headers], op)
    agree.check_same_leaves(headers)
    payload = headers[source].payload
  if payload is not None:
    buffer = np.frombuffer(payload, np.uint8)
  else:
    buffer = choice.broadcast(values if is_source else None, size,
                                   source, op=op, timeout=timeout,
                                   early=eager, relay=relay)
  return _leaves.rebuild(buffer, specs, treedef)


@metrics.recorded('broadcast_object')
def broadcast_object(obj: Any, is_source: bool | None = None, *,
                     timeout: float | None = None) -> Any:
  """Returns the source process's picklable `obj` on every process.

  Collective: every process must call this, in the same order.

  Any picklable value of any size: pickled, up to 64 KiB it travels with
  the call's agreement, larger in one broadcast of the data plane; either
  way sealed with the job secret and checked before it is unpickled. The
  source gets its own `obj` back; the others get an unpickled copy.

  Args:
    obj: the value (ignored on processes that are not the source).
    is_source: whether this process is the source. Default: process 0 is.
    timeout: seconds to wait for every process.

  Raises:
    ConsistencyError: no source or several sources.
    CollectiveTimeoutError: a process did not arrive in time (named).
  """
  op = 'broadcast_object'
  timeout = process.resolve_timeout(timeout)
  default_source = is_source is None
  if default_source:
    is_source = process.process_index() == 0
  if process.process_count() == 1:
    if not is_source:
      raise errors.ConsistencyError(
          f'{op}: no process is the source (the only process passed '
          'is_source=False). Pass is_source=True on exactly one process.')
    return obj
  data = objects.dumps(obj) if is_source else b''
  inline = is_source and len(data) <= agree.INLINE_BYTES
  seal = objects.seal(op, data, timeout) if is_source else b''
  header = agree.Header(op, size=len(data),
                        payload=data if inline else None,
                        default_source=default_source,
                        is_source=bool(is_source), seal=seal)
  # One agreement, and only the source's record of its object (size,
  # seal, inline bytes) to read; no process's header is exchanged unless
  # the calls differ. With the default source every process knows it is
  # process 0; with explicit ones each shares whether it is the source,
  # as `broadcast_one_to_all` does.
  if default_source:
    record, headers = agree.agree_and_read_one(
        header, 0, timeout=timeout,
        publish=objects.record(header) if is_source else None)
    source = 0
  else:
    records, headers = agree.agree_and_gather(
        header, timeout=timeout,
        publish=(_SOURCE + objects.record(header)) if is_source
        else _NOT_SOURCE)
    if records is not None:
      source = _one_source([r[:1] == _SOURCE for r in records], op)
      record = records[source][1:]
  if headers is None:
    size, seal, payload = objects.read_record(op, source, record)
  else:
    source = _one_source([h.is_source for h in headers], op)
    size, seal, payload = (headers[source].size, headers[source].seal,
                           headers[source].payload)
  objects.check_size(op, source, size)
  pickled: bytes | memoryview | None = payload
  if pickled is None:
    received = choice.broadcast(
        [np.frombuffer(data, np.uint8)] if is_source else None, size, source,
        op=op, timeout=timeout, source_result=False)
    if is_source:
      pickled = b''
    elif received is None:
      raise errors.MultihostError(
          f'{failures.prefix()} {op}: the transfer from process {source} '
          'returned no bytes.')
    else:
      pickled = received.data
  if is_source:
    return obj
  return objects.loads(op, source, pickled, seal, timeout)


def _one_source(is_source: list[bool], op: str) -> int:
  """The one process whose flag is set; raises unless there is exactly one."""
  sources = [p for p, flag in enumerate(is_source) if flag]
  if len(sources) == 1:
    return sources[0]
  what = 'no process is' if not sources else f'processes {sources} are all'
  raise errors.ConsistencyError(
      f'{failures.prefix()} {op}: {what} the source; exactly one process '
      'must pass is_source=True (by default process 0 is the source). '
      f'is_source by process: {is_source}.')
