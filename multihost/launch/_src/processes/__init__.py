"""The controller processes: what each is started with, spawning and reaping them, their output, signals, nothing outliving the launcher."""
