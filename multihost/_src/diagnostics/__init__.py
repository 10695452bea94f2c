"""Diagnostics: where every process is (the responder, SIGUSR1), stall reports, metrics, the trace format, and gloo's connection lines told apart in output that a reader filters."""
