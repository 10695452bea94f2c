"""Diagnostics: where every process is (the responder, SIGUSR1), stall reports, metrics and the trace format."""
