"""A store on disk: the versioned archive every checkpoint is (checkpoint.py: `save`,
`load`, optimizer states), numbered snapshots written in the background and found again
(snapshots.py), the one store of a process that snapshots into a folder (claims.py), and
the JSON-and-arrays `user_state` saved beside them (user_state.py)."""
