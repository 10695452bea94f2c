"""Running a resilient job: the training loop, its signal handlers, the replay check, and quiet logs for binaries."""
