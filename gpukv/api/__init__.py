"""The public face of one store: `create`, `KVStore`, the argument checks and checkpoints."""
