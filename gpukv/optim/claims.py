"""Which store of this process runs which optimizer: one at a time.

An `Optimizer` keeps per-update state of its own beside its options: the update count of
every key (by the key's name), `num_update`, and what a Trainer sets on it before each
step (`rescale_grad`, the learning rate). Two live stores running one optimizer object
would count each other's updates as their own (Adam's bias correction and a schedule's
rate would go wrong in both, as parameters of one name share a count) and take each
other's per-step options. So a store holds the optimizer it is given (`set_optimizer`; a
Trainer's store, from when the Trainer is made) until the store is garbage-collected,
takes another optimizer or an updater function, or its Trainer is closed; another store
of this process given it meanwhile is refused. (Each process of a dist job has its own
objects: nothing here crosses processes.)
"""
from __future__ import annotations

from .._errors import ArgumentError
from .._holders import Holders, store_kind

__all__ = ["claim", "holder", "release", "give_back", "refusal"]


def refusal(optimizer, held) -> ArgumentError:
    """The error for a store that would run `optimizer`, which the store `held` runs."""
    name = getattr(optimizer, "name", type(optimizer).__name__)
    return ArgumentError(
        f"optimizer {name!r}: {store_kind(held)} of this process (a Trainer's, or one "
        f"given set_optimizer) runs this optimizer object already. An optimizer keeps the "
        f"update counts (by key name) and per-step options (rescale_grad, the learning "
        f"rate) of the one store that runs it: shared, each store would count the "
        f"other's updates, and Adam's bias correction and learning-rate schedules would "
        f"go wrong in both. Give each store (or Trainer) an optimizer of its own: "
        f"gpukv.optim.create(...) again, or copy.deepcopy(optimizer). An optimizer is "
        f"free again once its store is dropped or given another optimizer, or its "
        f"Trainer closed")


#: an optimizer object (by identity, held weakly) -> the store that runs it
_OPTIMIZERS = Holders(id, refusal, weak_things=True)
#: `holder(optimizer, store=None, passing=())`, `claim(optimizer, store, passing=())`,
#: `give_back(optimizer, store, before)`, `release(optimizer, store)`: as for snapshot
#: folders (`gpukv.checkpoints.claims`), for the optimizer a store runs
holder, claim = _OPTIMIZERS.holder, _OPTIMIZERS.claim
give_back, release = _OPTIMIZERS.give_back, _OPTIMIZERS.release
