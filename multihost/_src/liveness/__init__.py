"""Liveness: the watchdog that turns a peer's death into an error, watched blocking calls, the exit handshake, and leaving after a peer's loss."""
