"""The engines a dist store drives between processes, behind `protocol.py`'s `Engine`:
sharded rounds (every process serves a shard, num_servers=0; `exchange.py` moves their
pieces), NCCL rounds (GPU data), and dedicated servers with their client; what a
deterministic engine is given and how its compressed leaves are summed (partials.py)."""
