"""The one-process store and the contract of every store: `KVStore` (base.py, the calls
every store implements), `LocalStore` (local.py: 'local', 'device', 'nccl'), the checks
of a call (check.py), a push's plan and run (pipeline.py) and row-sparse pulls (rows.py).
"""
