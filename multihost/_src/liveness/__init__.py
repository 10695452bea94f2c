"""Liveness: the watchdog that turns a peer's death into an error, watched blocking calls, the exit handshake, leaving after a peer's loss, and the step deadline that ends a stuck training step."""
