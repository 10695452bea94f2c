"""Public functions: fixed-size digests of arrays and pytrees (sharded leaves digested shard by shard)."""

from __future__ import annotations

from concurrent import futures
import functools
import hashlib
import math
from typing import Any
import zlib

import jax
import numpy as np

try:
  # ISA-L's CRC-32 is zlib's CRC-32 (the same values), several times faster.
  # Every digest of a large leaf is CRC-32s: assert_equal, leaf_digests,
  # checkpoint checks. The one CRC helper of this module.
  from isal.isal_zlib import crc32 as _crc32_of
except ImportError:  # a platform without isal's wheels: same values, slower
  _crc32_of = zlib.crc32

from multihost._src.api import gather
from multihost._src.runtime import leaves as _leaves

PyTree = Any

DIGEST_BYTES = 16
# Up to this size a leaf's bytes go through SHA-256 whole. Larger leaves are
# checksummed as CRC-32s of 4 MiB chunks on two threads (the CRC releases the
# GIL and is several times faster than SHA-256), and the checksums go
# through SHA-256. That detects accidental differences and corruption, like
# gzip's check, not deliberate collisions.
_WHOLE = 1 << 20
_CHUNK = 4 << 20

# Digest versions. 2 (also assert_equal's): each leaf's own dtype and bytes.
# 1, kept to check digests recorded with it: each leaf cast to the dtype JAX
# gives it on a device first (with jax_enable_x64 off, 64-bit NumPy leaves to
# 32 bits, their other bits unseen); the two agree on every other leaf.
VERSIONS = (1, 2)
VERSION = 2


@functools.cache
def _pool() -> futures.ThreadPoolExecutor:
  return futures.ThreadPoolExecutor(2, thread_name_prefix='multihost-digest')


def array_digest(value: np.ndarray, spec: _leaves.LeafSpec) -> bytes:
  """A 16-byte digest of a host array's spec (dtype, shape, key impl) and bytes."""
  h = hashlib.sha256(spec.describe().encode())
  data = np.require(value, requirements='C').reshape(-1).view(np.uint8).data
  if len(data) <= _WHOLE:
    h.update(data)
  else:
    chunks = [data[i:i + _CHUNK] for i in range(0, len(data), _CHUNK)]
    h.update(b'crc32-4MiB')
    for crc in _pool().map(_crc32_of, chunks):
      h.update(crc.to_bytes(4, 'little'))
  return h.digest()[:DIGEST_BYTES]


def _canonical(version: int, op: str) -> bool:
  """Whether digest `version` casts leaves to JAX's dtypes (`to_host`'s option)."""
  if version not in VERSIONS:
    raise ValueError(
        f'{op}: unknown digest version {version!r}; this multihost computes '
        f'versions {list(VERSIONS)}. Pass one of them, or upgrade multihost '
        '(on every process) to compute newer ones.')
  return version == 1


def _leaf_spec(x: jax.Array, canonical: bool) -> _leaves.LeafSpec:
  """The spec `to_host` gives a global array's full value (no data moved)."""
  if _leaves.is_key(x):
    data = jax.eval_shape(jax.random.key_data, x)
    return _leaves.LeafSpec(
        tuple(data.shape), _leaves.dtype_name(np.dtype(data.dtype)),
        str(jax.random.key_impl(x)), data.ndim - x.ndim)
  dtype = jax.dtypes.canonicalize_dtype(x.dtype) if canonical else x.dtype
  return _leaves.LeafSpec(tuple(x.shape), _leaves.dtype_name(np.dtype(dtype)))


def _elements(value: np.ndarray) -> np.ndarray:
  """A C-contiguous array's items as a 1-D array of same-size raw items."""
  size = value.dtype.itemsize
  kind = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(
      size, np.dtype((np.void, size)))
  return value.reshape(-1).view(kind)


@functools.cache
def _zero_crc(nbytes: int) -> int:
  return _crc32_of(bytes(nbytes))


class _Chunks:
  """One process's share of the CRC-32s of a global array's 4 MiB chunks.

  CRC-32 is affine over GF(2): for equal-length inputs, crc(a ^ b) =
  crc(a) ^ crc(b) ^ crc(zeros). So a chunk's CRC is crc(zeros) XOR the
  "contributions" crc(piece) ^ crc(zeros) of any split of the chunk into
  zero-padded pieces with disjoint supports, whichever processes hold them.
  Pieces arrive in runs of contiguous global items; a chunk covered whole by
  one run is read in place, other pieces are copied into one chunk-sized
  buffer (the only memory used besides small index batches).
  """

  def __init__(self, size: int, itemsize: int, kind: np.dtype):
    self.per = _CHUNK // itemsize  # items per chunk
    self.size = size  # items in the global array
    self.itemsize = itemsize
    self.kind = kind
    self.out = np.zeros(-(-size // self.per), np.uint32)
    self.whole: list[tuple[int, np.ndarray]] = []  # chunks read in place
    self.buffer: np.ndarray | None = None
    self.current = -1  # the chunk in `buffer`

  def _items(self, chunk: int) -> int:
    return min(self.per, self.size - chunk * self.per)

  def _open(self, chunk: int) -> np.ndarray:
    if chunk != self.current:
      self._flush()
      if self.buffer is None:
        self.buffer = np.empty(self.per, self.kind)
      self.buffer[:self._items(chunk)] = 0
      self.current = chunk
    if self.buffer is None:  # (`current` names a chunk only once it is made)
      raise RuntimeError(f'chunk {chunk} is current but has no buffer.')
    return self.buffer

  def _flush(self) -> None:
    if self.current >= 0 and self.buffer is not None:
      n = self._items(self.current)
      crc = _crc32_of(self.buffer[:n].view(np.uint8))
      self.out[self.current] ^= crc ^ _zero_crc(n * self.itemsize)
      self.current = -1

  def add_run(self, start: int, values: np.ndarray) -> None:
    """Items `values` at global positions start, start + 1, ..."""
    pos, end = start, start + len(values)
    while pos < end:
      chunk = pos // self.per
      first = chunk * self.per
      last = first + self._items(chunk)
      stop = min(end, last)
      piece = values[pos - start:stop - start]
      if pos == first and stop == last:
        self.whole.append((chunk, piece))
      else:
        self._open(chunk)[pos - first:stop - first] = piece
      pos = stop

  def add_rows(self, start: int, stride: int, rows: np.ndarray) -> None:
    """Items rows[j] at global positions start + j * stride + (0, 1, ...).

    Rows are shorter than `stride`; those inside one chunk are copied into
    its buffer with one strided assignment.
    """
    count, run = rows.shape
    j = 0
    while j < count:
      pos = start + j * stride
      chunk = pos // self.per
      first = chunk * self.per
      last = first + self._items(chunk)
      end = min(count, (last - run - start) // stride + 1)
      if end > j:  # Rows j..end-1 lie inside this chunk.
        buffer = self._open(chunk)
        size = buffer.itemsize
        np.lib.stride_tricks.as_strided(
            buffer[pos - first:], shape=(end - j, run),
            strides=(stride * size, size))[...] = rows[j:end]
        j = end
      else:  # Row j runs into the next chunk.
        self.add_run(pos, rows[j])
        j += 1

  def add_scattered(self, positions: np.ndarray, values: np.ndarray) -> None:
    """Items `values` at increasing global `positions`."""
    chunks = positions // self.per
    cuts = (np.flatnonzero(chunks[1:] != chunks[:-1]) + 1).tolist()
    for a, z in zip([0, *cuts], [*cuts, len(positions)]):
      chunk = int(chunks[a])
      self._open(chunk)[positions[a:z] - chunk * self.per] = values[a:z]

  def contributions(self) -> np.ndarray:
    """XOR over all processes, then XOR with `zero_crcs`: the chunk CRCs."""
    self._flush()
    crcs = _pool().map(lambda item: _crc32_of(item[1].view(np.uint8)),
                       self.whole)
    for (chunk, _), crc in zip(self.whole, crcs, strict=True):
      self.out[chunk] ^= crc ^ _zero_crc(self._items(chunk) * self.itemsize)
    self.whole = []
    return self.out

  def zero_crcs(self) -> np.ndarray:
    out = np.full(len(self.out), _zero_crc(self.per * self.itemsize),
                  np.uint32)
    if len(out):
      out[-1] = _zero_crc(self._items(len(out) - 1) * self.itemsize)
    return out


# Runs of at least this many items are added one by one; shorter ones at
# equal spacing by strided copies when there are enough of them (a 2-D array
# split along axis 1), else in batches of about _BATCH items with their
# positions computed by numpy.
_LONG_RUN = 1024
_BATCH = 1 << 20


def _add_shard(chunks: _Chunks, shape: tuple[int, ...],
               bounds: tuple[tuple[int, int], ...], values: np.ndarray
               ) -> None:
  """Adds one shard (C-order items `values` of the box `bounds`)."""
  k = len(shape) - 1  # The last axis the shard does not span whole.
  while k >= 0 and bounds[k] == (0, shape[k]):
    k -= 1
  if k < 0:
    chunks.add_run(0, values)
    return
  strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
  base = sum(bounds[d][0] * strides[d] for d in range(k + 1))
  run = (bounds[k][1] - bounds[k][0]) * strides[k]  # items per run
  outer = [bounds[d][1] - bounds[d][0] for d in range(k)]
  runs = values.reshape(math.prod(outer), run)

  def starts(first: int, stop: int, step: int = 1) -> np.ndarray:
    rest = np.arange(first, stop, step, dtype=np.int64)
    out = np.full(len(rest), base, np.int64)
    for d in reversed(range(k)):
      out += (rest % outer[d]) * strides[d]
      rest //= outer[d]
    return out

  if run >= _LONG_RUN:
    for r, start in enumerate(starts(0, len(runs)).tolist()):
      chunks.add_run(start, runs[r])
    return
  group = outer[-1] if outer else 1  # Runs at equal spacing strides[k - 1].
  if k and group * run >= _LONG_RUN:
    for g, start in enumerate(starts(0, len(runs), group).tolist()):
      chunks.add_rows(start, strides[k - 1],
                      runs[g * group:(g + 1) * group])
    return
  per_batch = max(1, _BATCH // run)
  offsets = np.arange(run, dtype=np.int64)
  for first in range(0, len(runs), per_batch):
    stop = min(len(runs), first + per_batch)
    positions = (starts(first, stop)[:, None] + offsets).reshape(-1)
    chunks.add_scattered(positions, runs[first:stop].reshape(-1))


def _shard_contributions(x: jax.Array, spec: _leaves.LeafSpec, op: str,
                         canonical: bool) -> _Chunks:
  """This process's contributions to the chunk CRCs of a sharded array.

  Each distinct shard counts once: the replica with replica_id 0 (on
  whichever process holds it).
  """
  itemsize = _leaves.np_dtype(spec.dtype).itemsize
  kind = _elements(np.zeros(0, _leaves.np_dtype(spec.dtype))).dtype
  chunks = _Chunks(math.prod(spec.shape), itemsize, kind)
  key_bounds = tuple((0, n) for n in spec.shape[x.ndim:])
  for shard in x.addressable_shards:
    if shard.replica_id != 0:
      continue
    # (A key array's shard index may also cover its key data's axes.)
    bounds = tuple(s.indices(n)[:2]
                   for s, n in zip(shard.index[:x.ndim], x.shape, strict=True))
    value, _ = _leaves.to_host(shard.data, op, canonical=canonical)
    if value.size:
      _add_shard(chunks, spec.shape, bounds + key_bounds, _elements(value))
  return chunks


def _from_crcs(spec: _leaves.LeafSpec, crcs: np.ndarray) -> bytes:
  """`array_digest` of a value over 1 MiB, from its chunk CRC-32s."""
  h = hashlib.sha256(spec.describe().encode())
  h.update(b'crc32-4MiB')
  h.update(crcs.astype('<u4').tobytes())
  return h.digest()[:DIGEST_BYTES]


def _is_sharded(x) -> bool:
  return _leaves.is_global(x) and not x.is_fully_replicated


def _digests(leaves: list, op: str, version: int) -> list[bytes]:
  """`array_digest` of each leaf's global value, never gathering it whole.

  A leaf sharded across processes up to 1 MiB is gathered. A larger one is
  digested from its chunk CRC-32s: each process computes its shards'
  contributions to them, and one all-gather of those (4 bytes per 4 MiB
  chunk of every such leaf) combines them. Collective when some leaf is
  sharded across processes.
  """
  canonical = _canonical(version, op)
  out: list[bytes | None] = [None] * len(leaves)
  pending = []  # (index, spec, chunks)
  for i, x in enumerate(leaves):
    if _is_sharded(x):
      spec = _leaf_spec(x, canonical)
      if spec.nbytes > _WHOLE:
        pending.append((i, spec, _shard_contributions(x, spec, op,
                                                      canonical)))
        continue
      x = gather.process_allgather(x, tiled=True)
    elif _leaves.is_global(x):
      x = x.addressable_data(0)
    out[i] = array_digest(*_leaves.to_host(x, op, canonical=canonical))
  if pending:
    mine = np.concatenate([c.contributions() for _, _, c in pending])
    combined = np.bitwise_xor.reduce(gather.process_allgather(mine), axis=0)
    offset = 0
    for i, spec, chunks in pending:
      n = len(chunks.out)
      out[i] = _from_crcs(spec, combined[offset:offset + n] ^
                          chunks.zero_crcs())
      offset += n
  return [_made(i, digest) for i, digest in enumerate(out)]


def _made(i: int, digest: bytes | None) -> bytes:
  """Leaf `i`'s digest, which every leaf has once the loops above ran."""
  if digest is None:
    raise RuntimeError(f'leaf {i} got no digest.')
  return digest


def leaf_digests(tree: PyTree, *, version: int = VERSION) -> dict[str, str]:
  """Returns a hex digest of each leaf's global value, keyed by its path.

  Keys are `jax.tree_util.keystr` paths (e.g. "['params']['w']"), in
  flattening order. A leaf's digest covers its dtype, shape and every bit
  of its items in that dtype (a NumPy float64 leaf as float64, whatever
  jax_enable_x64 says; for typed PRNG keys: the key data and
  implementation), so it is the same for the same global value on any
  process, mesh or process count.

  Collective only when the tree holds global arrays that are neither fully
  addressable nor fully replicated (every process must then call this, in
  the same order). Otherwise it is local. Such an array is never gathered
  whole (only up to 1 MiB): each process digests its own shards, and the
  processes exchange 4 bytes per 4 MiB of it.

  Args:
    tree: a pytree of arrays and scalars.
    version: 2 (the default) or 1, the digests of earlier versions, which
      cast each leaf to JAX's dtypes first (with jax_enable_x64 off, 64-bit
      NumPy leaves to 32 bits).

  Returns:
    A dict from leaf path to a 32-character hex digest.

  Raises:
    ValueError: `version` is not one this multihost computes.
  """
  leaves, paths, _ = _leaves.flatten(tree, 'leaf_digests')
  return {path: digest.hex() for path, digest in zip(
      paths, _digests(leaves, 'leaf_digests', version), strict=True)}


def tree_digest(tree: PyTree, *, version: int = VERSION) -> str:
  """Returns a hex digest of a pytree's structure, shapes, dtypes and values.

  Equal trees give equal digests on any process and any topology: the digest
  depends on the global value of each leaf, not on how it is sharded.

  Collective only when the tree holds global arrays that are neither fully
  addressable nor fully replicated (every process must then call this, in
  the same order); they are not gathered whole (see `leaf_digests`).
  Otherwise it is local.

  Args:
    tree: a pytree of arrays and scalars.
    version: the digest version of its leaves (see `leaf_digests`).

  Returns:
    A 32-character hex string.

  Raises:
    ValueError: `version` is not one this multihost computes.
  """
  h = hashlib.sha256(_leaves.signature(jax.tree.structure(tree)).encode())
  for path, digest in leaf_digests(tree, version=version).items():
    h.update(path.encode())
    h.update(bytes.fromhex(digest))
  return h.hexdigest()[:2 * DIGEST_BYTES]


def local_digest(x, op: str) -> tuple[bytes, _leaves.LeafSpec]:
  """A fully addressable leaf's `VERSION` digest and its spec (own dtype)."""
  value, spec = _leaves.to_host(x, op, canonical=False)
  return array_digest(value, spec), spec


def shard_digests(x: jax.Array, op: str) -> list[tuple[tuple, bytes]]:
  """(bounds, `VERSION` digest) of each distinct addressable shard of a global array."""
  return [(bounds, array_digest(value, spec))
          for bounds, value, spec in _leaves.distinct_shards(
              x, op, canonical=False)]
