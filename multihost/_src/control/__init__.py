"""The control plane: before any data moves, every process agrees on the call it is about to make (through the coordination service or over the TCP links), and the live processes' barrier."""
