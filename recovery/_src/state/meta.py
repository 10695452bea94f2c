"""A checkpoint's `meta` item: what a save records, and the restore checks against it.

Each check raises on its own process with the step, the folder, what differed
and what to do (`hint`: the step to fall back to). The comparison across
controllers after a restore is `state.consistency`'s.
"""

from __future__ import annotations

from typing import Any

import jax

from multihost import process_prefix as _prefix
from recovery._src.state import digest
from recovery._src.state import leaves
from recovery._src.state.errors import CheckpointCorruptError
from recovery._src.state.errors import CheckpointError
from recovery._src.state.errors import CheckpointMismatchError

FORMAT = 'recovery-checkpoint-v2'
# Earlier formats this version restores: v1 stored the same leaves (global
# jax.Arrays and NumPy arrays, in nested dicts) and did not list their kinds.
READABLE_FORMATS = (FORMAT, 'recovery-checkpoint-v1')


def build(state, raw, tree, digests: dict[str, str], *, reason: str,
          storage: dict[str, str] | None = None) -> dict[str, Any]:
  """The meta item of `state`: `raw` is `state.to_tree()`, `tree` its storable form.

  `storage` ({path: dtype name}) records the dtype each leaf is written in
  (a carrier's where TensorStore does not store the leaf's own), which
  the restore reads it as; `leaves` names the leaves' own dtypes.
  """
  return {
      'format': FORMAT,
      'step': state.step,
      'epoch': state.epoch,
      'cursor': state.cursor,
      'digest': digest.combine(digests),
      'leaf_digests': digests,
      'digest_algorithm': digest.DIGEST_ALGORITHM,
      'key_impl': str(jax.random.key_impl(state.key)),
      'leaves': leaf_specs(tree),
      'kinds': leaf_kinds(raw),
      'process_count': jax.process_count(),
      'device_count': jax.device_count(),
      'reason': reason,
      **({} if storage is None else {'storage': storage}),
  }


def leaf_specs(stored) -> dict[str, list]:
  """{path: [shape, dtype]} of a storable (or abstract storable) tree."""
  return {digest.path_name(path): leaves.spec(leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(stored)[0]}


def leaf_kinds(tree) -> dict[str, str]:
  """{path: how the saving run held the leaf}, for people reading metadata."""
  flat, _ = leaves.leaves(tree)
  return {leaf.name: leaves.kind(leaf.value) for leaf in flat}


def check_format(meta: dict[str, Any], *, where: str, hint: str) -> None:
  """Raises `CheckpointError` unless `meta` is of a format this version reads.

  Its digest algorithm included (`check_algorithm`).
  """
  if meta.get('format') not in READABLE_FORMATS or 'digest' not in meta:
    raise CheckpointError(
        f'{_prefix()} {where} is not a {" or ".join(READABLE_FORMATS)} '
        f'checkpoint (format {meta.get("format")!r}, metadata keys: '
        f'{sorted(meta)}). {hint}')
  check_algorithm(meta, where=where)


def check_algorithm(meta: dict[str, Any], *, where: str) -> str:
  """The digest algorithm `meta` names; `CheckpointError` unless this version checks it.

  Every process reads the same meta, so every process checks a checkpoint
  with the same algorithm (or raises alike).
  """
  name = meta.get('digest_algorithm')
  if name not in digest.ALGORITHMS:
    raise CheckpointError(
        f'{_prefix()} {where} was digested with {name!r}, which this version '
        f'of recovery cannot check (it checks {", ".join(digest.ALGORITHMS)}'
        '). A newer version wrote it: upgrade multihost on every process to '
        'restore it (or restore it with the version that wrote it); to '
        'resume from an older step instead, move this one out of the folder.')
  return name


def check_fits(meta: dict[str, Any], abstract, *, where: str) -> None:
  """Raises `CheckpointMismatchError` unless the stored leaves fit the target's."""
  want = leaf_specs(abstract)
  have = meta.get('leaves', {})
  problems = []
  for name in sorted(set(want) | set(have)):
    if name not in have:
      problems.append(f'{name}: missing from the checkpoint, this run '
                      f'expects {want[name]}')
    elif name not in want:
      problems.append(f'{name}: in the checkpoint ({have[name]}) but not '
                      'in this run\'s state')
    elif list(have[name]) != list(want[name]):
      problems.append(f'{name}: checkpoint has {have[name]}, this run '
                      f'expects {want[name]}')
  if problems:
    raise CheckpointMismatchError(
        f'{_prefix()} {where} does not fit this run: ' + '; '.join(problems)
        + '. It was made with a different model or data configuration: '
        'restore it onto a target built with the configuration that made it, '
        'or start fresh in a new folder.')


def changed_leaves(meta: dict[str, Any], digests: dict[str, str]) -> list[str]:
  """The leaves whose digests differ from those `meta` stored, sorted."""
  stored = meta.get('leaf_digests', {})
  return sorted(k for k in digests if stored.get(k) != digests[k])


def check_digest(meta: dict[str, Any], restored, *, where: str,
                 hint: str) -> dict[str, str]:
  """Checks the restored tree's digest against the stored one; returns its leaf digests.

  Collective (when some leaf is sharded across processes): every process
  must call this, in the same order.

  Raises:
    CheckpointError: the checkpoint names a digest algorithm this version
      does not check (`check_algorithm`).
    CheckpointCorruptError: the digests differ (the changed leaves named).
  """
  algorithm = check_algorithm(meta, where=where)
  digests = digest.checkpoint_leaf_digests(restored, algorithm=algorithm)
  got = digest.combine(digests, algorithm=algorithm)
  if got != meta['digest']:
    changed = changed_leaves(meta, digests)
    finding = (f'fails its digest check: stored {meta["digest"][:16]}..., '
               f'restored state digests to {got[:16]}... (leaves that '
               f'changed: {", ".join(changed) or "unknown"})')
    raise CheckpointCorruptError(
        f'{_prefix()} {where} {finding}. Its files were altered or damaged '
        f'after the save committed; refusing to resume from it. {hint}',
        why=f'it {finding}')
  return digests
