"""The stores: `create` (factory.py), the contract every store implements (`KVStore`,
base.py), the one-process store (`LocalStore`, store.py) with its checks, push pipeline,
row-sparse pulls and checkpoints, and the store shared by the processes of an MPI job
(`DistKVStore`, dist_store.py, with the one-process stores it is made of)."""
