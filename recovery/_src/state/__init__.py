"""The transition state and what identifies it: leaves as Orbax stores them, digests, the cross-process consistency check, the meta record, errors."""
