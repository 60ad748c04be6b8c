"""The public face of the stores: `create` (factory.py) and the names `gpukv` re-exports.

The stores themselves: `gpukv.store` (the contract `KVStore` and the one-process
`LocalStore`), `gpukv.distributed` (`DistKVStore`, across the processes of an MPI job).
"""
