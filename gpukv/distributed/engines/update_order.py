"""The order one process's optimizer counts the keys of a push in, for the engines whose
processes (or servers) each update only some of them.

An optimizer's learning-rate schedule is asked for `num_update`, the largest update
count of any key so far, which grows as a push's keys are counted one after another
(`Optimizer.next_scalars`). So that a key's rate does not depend on which process serves
it, every process counts every key of a push, served there or not, in the order one
process would (`Optimizer.counting_round`): MXNet's, int keys ascending and str keys in
the order they were made.
"""
from __future__ import annotations


class UpdateOrder:
    """The keys made so far, in order, and the order of a push's keys by them."""

    def __init__(self) -> None:
        self._made: dict = {}  # key -> its place among the keys made

    def made(self, keys) -> None:
        """`keys` were made, in this order (after those made before)."""
        for key in keys:
            self._made.setdefault(key, len(self._made))

    def of(self, keys) -> list:
        """`keys` (those of one push, each once; all int or all str) as one process
        counts them: int keys ascending, str keys in the order they were made."""
        keys = list(dict.fromkeys(keys))
        if keys and isinstance(keys[0], str):
            made = self._made
            return sorted(keys, key=lambda key: made.get(key, len(made)))
        return sorted(keys)
