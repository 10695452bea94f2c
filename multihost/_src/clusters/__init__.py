"""Cluster environments JAX does not detect, or detects with unbounded lookups: Open MPI 5 (PRRTE and PMIx), Cloud TPU."""
