"""A store on disk: the versioned archive every checkpoint is (checkpoint.py: `save`,
`load`, optimizer states), numbered snapshots written in the background and found again
(snapshots.py), and the JSON-and-arrays `user_state` saved beside them (user_state.py)."""
