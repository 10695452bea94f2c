"""Public collective: assert_equal, every process holds the same tree, compared by digests."""

from __future__ import annotations

from typing import Any

import numpy as np

from multihost._src.api import digest as _digest
from multihost._src.api import gather
from multihost._src.control import agree
from multihost._src.diagnostics import metrics
from multihost._src.runtime import errors
from multihost._src.runtime import failures
from multihost._src.runtime import leaves as _leaves
from multihost._src.runtime import process

PyTree = Any

_MAX_REPORTED = 8


@metrics.recorded('assert_equal')
def assert_equal(in_tree: PyTree, fail_message: str = '', *,
                 timeout: float | None = None,
                 show_diff: bool = False) -> None:
  """Raises on every process unless every process passed an equal tree.

  Collective: every process must call this, in the same order.

  Drop-in for `jax.experimental.multihost_utils.assert_equal`, but it
  compares a 16-byte digest per leaf instead of gathering the tree: the
  extra memory is at most about the payload, and the error names the
  differing leaf paths and which processes hold which digest (never the
  whole tree). For a global jax.Array that is not fully addressable, each
  process digests its own shards with their indices, and every shard held
  by several processes must agree.

  Args:
    in_tree: pytree of arrays and scalars.
    fail_message: prefix for the error message.
    timeout: seconds to wait for every process.
    show_diff: when leaves differ, also gather those leaves (only those) and
      report the max abs difference from the lowest process of the largest
      group, and the values when they are small.

  Raises:
    ConsistencyError: (also an AssertionError) trees, shapes, dtypes or
      values differ; raised on every process.
    CollectiveTimeoutError: a process did not arrive in time (named).
  """
  op = 'assert_equal'
  timeout = process.resolve_timeout(timeout)
  leaves, paths, treedef = _leaves.flatten(in_tree, op)
  if process.process_count() == 1:
    return
  specs: list[_leaves.LeafSpec] = []
  # Per leaf: a host leaf's digest, or a global leaf's shard digests.
  digests: list[bytes | list[tuple[tuple[Any, ...], bytes]]] = []
  for x in leaves:
    if _leaves.is_global(x):
      digests.append(_digest.shard_digests(x, op))
      specs.append(_leaves.LeafSpec(tuple(x.shape), str(x.dtype)))
    else:
      digest, spec = _digest.local_digest(x, op)
      digests.append(digest)
      specs.append(spec)
  has_global = any(isinstance(d, list) for d in digests)
  header = agree.Header(op, _leaves.signature(treedef), tuple(paths),
                                 tuple(specs), digests=tuple(digests))
  # Equal trees prove themselves with one barrier (the fast path). Global
  # leaves' shards differ by process by design: every process reads every
  # header (beside the same barrier) and compares them shard by shard.
  if has_global:
    headers = agree.full_exchange(header, timeout=timeout)
  else:
    differ = agree.agree(header, timeout=timeout).headers
    if differ is None:
      return
    headers = differ
  prefix = f'{fail_message} ' if fail_message else ''
  try:
    agree.check_same_leaves(headers)
  except errors.ConsistencyError as e:
    raise errors.ConsistencyError(prefix + str(e)) from None
  all_digests = [h.digests for h in headers]
  differing = []  # (leaf index, description)
  for i, path in enumerate(paths):
    per_process = [d[i] for d in all_digests]
    if isinstance(per_process[0], bytes):
      if len(set(per_process)) > 1:
        differing.append((i, f'{path}: ' + failures.groups(
            per_process, render=_render_digest)))
    else:
      described = _shard_disagreements(per_process)
      if described:
        differing.append((i, f'{path}: {described}'))
  if not differing:
    return
  lines = [d for _, d in differing[:_MAX_REPORTED]]
  more = len(differing) - len(lines)
  message = (f'{prefix}{failures.prefix()} {op}: {len(differing)} of '
             f'{len(paths)} leaves differ across processes:\n  ' +
             '\n  '.join(lines) + (f'\n  ... and {more} more' if more else ''))
  if show_diff:
    message += _describe_values(leaves, paths, [i for i, _ in differing
                                                [:_MAX_REPORTED]],
                                all_digests, timeout)
  raise errors.ConsistencyError(message)


def _shard_disagreements(per_process) -> str:
  """Describes shards (by index) whose replicas differ between processes."""
  by_bounds: dict = {}
  for p, shards in enumerate(per_process):
    for bounds, digest in shards:
      by_bounds.setdefault(bounds, {})[p] = digest
  out = []
  for bounds, holders in sorted(by_bounds.items()):
    if len(set(holders.values())) > 1:
      where = ', '.join(f'{a}:{b}' for a, b in bounds)
      groups: dict = {}
      for p, d in holders.items():
        groups.setdefault(d, []).append(p)
      out.append(f'shard [{where}]: ' + '; '.join(
          f'processes {ps} hold digest {d.hex()[:12]}'
          for d, ps in groups.items()))
  return ' | '.join(out)


def _describe_values(leaves, paths, indices, all_digests, timeout) -> str:
  """Gathers only the differing host-local leaves and describes them."""
  local = [i for i in indices if not _leaves.is_global(leaves[i])]
  if not local:
    return ''
  gathered = gather.process_allgather([leaves[i] for i in local],
                                       timeout=timeout)
  out = []
  for i, stacked in zip(local, gathered, strict=True):
    digests = [d[i] for d in all_digests]
    counts = {d: digests.count(d) for d in digests}
    ref = digests.index(max(counts, key=lambda d: (counts[d], d == digests[0])))
    values = np.asarray(stacked)
    try:
      diffs = [float(np.max(np.abs(values[p].astype(np.float64) -
                                   values[ref].astype(np.float64))))
               if values[p].size else 0.0 for p in range(len(values))]
      text = (f'{paths[i]}: max abs difference from process {ref}, by '
              f'process: {[round(d, 8) for d in diffs]}')
    except (TypeError, ValueError):
      text = f'{paths[i]}: values are not numeric'
    if values[0].size <= 8:
      text += f'; values by process: {[v.tolist() for v in values]}'
    out.append(text)
  return '\nDifferences (show_diff=True):\n  ' + '\n  '.join(out)


def _render_digest(digest: object) -> str:
  """A host leaf's digest, as differences show it (its first 12 hex digits)."""
  return f'digest {digest.hex()[:12]}' if isinstance(digest, bytes) else repr(
      digest)
