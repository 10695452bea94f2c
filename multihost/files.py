"""Atomic, symlink-safe file writes: the one writer of this project (multihost's trace files, recovery's local checkpoint tier and run identity), public for programs that write files beside them.

A write goes to a temporary file in the target's own folder, under an
unpredictable name, created exclusively and never through a link, is
flushed to disk, then renamed over the target: a reader sees the old file or
the new one, never a part. JAX-free.
"""

from multihost._src.runtime.files import fsync_folder as fsync_folder
from multihost._src.runtime.files import write_atomic as write_atomic

__all__ = ['fsync_folder', 'write_atomic']
