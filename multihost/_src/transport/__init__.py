"""The data plane: the `Transport` interface, its TCP and device implementations, the choice between them, and the result pool."""
