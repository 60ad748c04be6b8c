"""A program the retake kill tests start: `python retake_writer.py ROOT KILL_AT`. It
snapshots a store at steps 4 and 5, pushes, then snapshots step 5 again (what a Trainer's
`checkpoint_every` and its `snapshot()` at one step do), killing itself (SIGKILL) just
before the KILL_AT-th file operation of that second snapshot: a file removed, a file's
write begun, a file renamed into place. It prints "done" if it got through."""
from __future__ import annotations

import os
import signal
import sys

import numpy as np

#: the user_state each take saves ({"take": name}), and the value its key then has
SIZE = 1000
TAKES = {"step 4": 0.0, "step 5, first": 0.0, "step 5, second": 1.0}


def main(root: str, kill_at: int) -> None:
    import gpukv
    from gpukv.checkpoints import snapshots
    kv = gpukv.create("local")
    kv.init(0, np.zeros(SIZE, np.float32))
    kv.set_optimizer(gpukv.optim.SGD(learning_rate=1.0))
    kv.snapshot(root, 4, user_state={"take": "step 4"})
    kv.snapshot(root, 5, user_state={"take": "step 5, first"})
    kv.finish_snapshots()
    kv.push(0, np.full(SIZE, -1, np.float32))
    seen = [0]

    def counted(call):
        def wrapped(*args, **kwargs):
            where = os.fspath(args[0])
            if os.path.isabs(where) and where.startswith(root):
                seen[0] += 1
                if seen[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return call(*args, **kwargs)
        return wrapped
    os.replace = counted(os.replace)
    os.unlink = counted(os.unlink)
    os.remove = counted(os.remove)
    snapshots.write_archive = counted(snapshots.write_archive)
    kv.snapshot(root, 5, user_state={"take": "step 5, second"})
    kv.finish_snapshots()
    print("done", flush=True)


if __name__ == "__main__":
    main(os.path.abspath(sys.argv[1]), int(sys.argv[2]))
