"""The public functions, one module per family: each checks its input, agrees through `control`, and moves data through `transport`."""
