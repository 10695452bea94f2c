"""Pytest plugin for multi-controller tests (work in progress)."""
