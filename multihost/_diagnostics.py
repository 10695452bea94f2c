"""Failure and diagnostics: the `[process=N]` prefix and message shortening every error uses."""

from __future__ import annotations

import jax


def prefix(index: int | None = None) -> str:
  """'[process=N]' for this process (or for `index`), the start of every message."""
  return f'[process={jax.process_index() if index is None else index}]'


def shorten(message: object, limit: int = 400) -> str:
  """`message` (a string or an exception) on one line, cut to `limit` characters."""
  text = ' '.join(str(message).split())
  return text if len(text) <= limit else text[:limit] + '...'
