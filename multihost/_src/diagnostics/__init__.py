"""Diagnostics: where every process is (the responder, SIGUSR1), stall reports, metrics, the trace format, and stdout without gloo's connection lines."""
