"""How a key is laid out across the processes that serve it, for the engines and for
checkpoints alike: its pieces (pieces.py: small keys whole on one server, big keys split
into one contiguous piece per server) and its optimizer state merged from, or cut back
into, those pieces (state.py)."""
