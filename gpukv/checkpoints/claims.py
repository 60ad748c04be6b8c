"""Which store of this process snapshots into which folder: one at a time.

Two live stores snapshotting into one folder would take each other's snapshots for their
own: a store's first snapshot there counts one run more than the folder holds
(`snapshots.next_run`), so the second store's snapshots are the newest, a resume (a
Trainer made there) starts from them, whichever model wrote them, and each store's prune
removes the other's snapshots, one being written included. So a store holds a folder from
its first snapshot there (a Trainer's, from when the Trainer is made) until it is
garbage-collected or lets it go (`Trainer.close`), and another store of this process that
snapshots there meanwhile is refused. (Across processes, a Trainer on a one-process store
refuses a job of several: `gpukv.torch.trainer`.)
"""
from __future__ import annotations

import os

from .._errors import ArgumentError
from .._holders import Holders, store_kind

__all__ = ["claim", "holder", "release", "give_back", "refusal"]


def refusal(root, held) -> ArgumentError:
    """The error for a store that would snapshot into `root`, which `held` uses."""
    return ArgumentError(
        f"{os.fspath(root)}: {store_kind(held)} of this process snapshots into this folder "
        f"already; in one folder each would take the other's snapshots for its own (a "
        f"resume, or a Trainer made there, would start from the other model's, and each "
        f"would prune the other's). Give each model its own checkpoint_dir (or snapshot "
        f"root); a folder is free again once its store is dropped, or its Trainer closed")


def _folder(root) -> str:
    return os.path.realpath(os.fspath(root))


#: a folder (by its real path, whatever path names it) -> the store snapshotting there
_FOLDERS = Holders(_folder, refusal)
#: `holder(root, store=None, passing=())`: the live store of this process that snapshots
#: into `root`, unless it is `store` or one of `passing` (None: none);
#: `claim(root, store, passing=())`: hold `root` for `store` (ArgumentError naming the
#: folder, changing nothing, when another live store holds it), returning what held it
#: before for `give_back(root, store, before)`; `release(root, store)`: free it
holder, claim = _FOLDERS.holder, _FOLDERS.claim
give_back, release = _FOLDERS.give_back, _FOLDERS.release
