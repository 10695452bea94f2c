"""TCP transport: authenticated links between processes (listener, handshake, frames, socket I/O) and the chain and ring algorithms over them."""
