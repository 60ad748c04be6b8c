"""A program the kill tests start: `python snapshot_writer.py ROOT`. It snapshots a store
whose every value is a known function of the step (`expected`), one step after another,
until it is killed; SGD changes the values in place between steps, so a snapshot whose
arrays were not copied when it was taken would show it. It prints "looping" once the loop starts."""
from __future__ import annotations

import sys

import numpy as np

#: key -> number of float32 elements (several MB, so that a write takes a while; the
#: user_state holds key 2's value too, so that the worker file does)
SIZES = {0: 1_500_000, 1: 500_000, 2: 1_000_000}


def expected(key: int, step: int) -> np.ndarray:
    """The value of `key` at `step`."""
    return np.arange(SIZES[key], dtype=np.float32) % 1000 + np.float32(step * 1000 + key)


def main(root: str) -> None:
    import gpukv
    kv = gpukv.create("local")
    kv.init(list(SIZES), [expected(k, 0) for k in SIZES])
    # each step adds 1000 to every value, in place (exactly: integers below 2**24)
    kv.set_optimizer(gpukv.optim.SGD(learning_rate=1.0))
    steps = [np.full(size, -1000, np.float32) for size in SIZES.values()]
    print("looping", flush=True)
    step = 0
    while True:
        kv.snapshot(root, step, user_state={"step": step, "check": expected(2, step)},
                    keep=2)
        step += 1
        kv.push(list(SIZES), steps)


if __name__ == "__main__":
    main(sys.argv[1])
