"""Control plane: a typed, versioned encoding of call headers (JSON; never pickle).

A header is a flat record of a few value types: None, bool, int, str,
bytes, lists, tuples and `LeafSpec`s. Each is written as JSON with a tag
where JSON lacks the type (bytes, tuples, leaf specs), under a version
number; `decode` rebuilds exactly those types and nothing else, so a
message read from the key-value store can never run code.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

from multihost._src.runtime import errors
from multihost._src.runtime import leaves

# 2: assert_equal's per-leaf digests are of each leaf's own dtype and bytes
# (digest version 2), so a process of an earlier version is named as one.
VERSION = 2


def _pack(value: Any) -> Any:
  if value is None or isinstance(value, (bool, int, str)):
    return value
  if isinstance(value, bytes):
    return {'b': base64.b64encode(value).decode()}
  if isinstance(value, tuple):
    return {'t': [_pack(v) for v in value]}
  if isinstance(value, list):
    return [_pack(v) for v in value]
  if isinstance(value, leaves.LeafSpec):
    return {'L': [_pack(value.shape), value.dtype, value.key_impl,
                  value.key_dims]}
  raise TypeError(f'the control plane cannot encode {type(value).__name__} '
                  f'values ({value!r:.80})')


def _unpack(value: Any) -> Any:
  if value is None or isinstance(value, (bool, int, str)):
    return value
  if isinstance(value, list):
    return [_unpack(v) for v in value]
  if isinstance(value, dict) and len(value) == 1:
    (tag, inner), = value.items()
    if tag == 'b' and isinstance(inner, str):
      return base64.b64decode(inner, validate=True)
    if tag == 't' and isinstance(inner, list):
      return tuple(_unpack(v) for v in inner)
    if tag == 'L' and isinstance(inner, list) and len(inner) == 4:
      shape, dtype, key_impl, key_dims = inner
      shape = _unpack(shape)
      if (isinstance(shape, tuple) and all(type(d) is int for d in shape)
          and isinstance(dtype, str) and type(key_dims) is int
          and (key_impl is None or isinstance(key_impl, str))):
        return leaves.LeafSpec(shape, dtype, key_impl, key_dims)
  raise ValueError(f'unexpected value {value!r:.80}')


def canonical(value: Any) -> bytes:
  """`value` (of the encodable types) as canonical bytes, for digests."""
  return json.dumps(_pack(value), separators=(',', ':')).encode()


def encode(record: Any) -> bytes:
  """`record` (a dataclass of encodable fields) as versioned JSON bytes."""
  fields = {f.name: _pack(getattr(record, f.name))
            for f in dataclasses.fields(record)}
  return json.dumps({'v': VERSION, 'f': fields},
                    separators=(',', ':')).encode()


def decode(cls: type, data: bytes, *, where: str) -> Any:
  """The `cls` record in `data`; a clear error for anything else.

  Raises:
    MultihostError: `data` is not a version-VERSION record of `cls`.
  """
  names = {f.name for f in dataclasses.fields(cls)}
  try:
    message = json.loads(data)
    if message.get('v') != VERSION:
      raise ValueError(f'version {message.get("v")!r}, expected {VERSION}')
    fields = message['f']
    if not isinstance(fields, dict) or not set(fields) <= names:
      raise ValueError(f'unknown fields {sorted(set(fields) - names)}')
    return cls(**{k: _unpack(v) for k, v in fields.items()})
  except (ValueError, TypeError, KeyError, AttributeError) as e:
    raise errors.MultihostError(
        f'{where}: a control message could not be decoded ({e}). Every '
        'process must run the same multihost version; restart the job.'
    ) from e
