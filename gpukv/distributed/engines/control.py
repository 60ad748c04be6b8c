"""`protocol.Control`, done once for every engine: who this worker is, and the calls every
worker makes together (a barrier, a checkpoint call, a maximum, rank 0's objects), each
agreed on first (`mpi.agree.Agreement`) and bounded.

An engine gives it the steps that are its own: `settle(op)`, the first step of every
collective call (the keys made before it, agreed on or answered by their servers), and
`drain(op)`, which a barrier adds (every worker's earlier calls applied where the keys are
served: nothing where the rounds are collective already); `reported()` raises a failure
the engine heard of apart from the workers' transport (a server's report)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..mpi.agree import Agreement, from_rank0, to_rank0
from ..mpi.transport import Transport


def _nothing(what: str) -> None:
    return None


class WorkerControl:
    """The workers' calls made together, over `workers` (the transport of the workers
    alone: servers excluded)."""

    def __init__(self, workers: Transport, settle: Callable[[str], None],
                 drain: Callable[[str], None] = _nothing,
                 reported: Callable[[], None] | None = None):
        self.workers = workers
        self.agree = Agreement(workers)
        self._settle = settle
        self._drain = drain
        self._reported = reported

    @property
    def rank(self) -> int:
        return self.workers.rank

    @property
    def num_workers(self) -> int:
        return self.workers.size

    def failed(self) -> bool:
        """Whether an earlier call met a failure (its transport's, which stays)."""
        return self.workers.failure is not None

    def check(self) -> None:
        """Raise the failure an earlier call met (or a peer reported), if any."""
        self.workers.check()
        if self._reported is not None:
            self._reported()

    def barrier(self) -> None:
        """Every worker's earlier calls are done where the keys are served, then the
        workers meet."""
        self._settle("barrier")
        self._drain("barrier")
        self.agree.check(("barrier", ()), "barrier")

    def collective(self, op: str, note: str | None = None) -> None:
        """Every worker makes call `op` now: agreed on before anything of it moves, so a
        worker on another call fails, naming both (and `note`, this worker's words said
        beside its call, not compared: a refusal's error)."""
        self._settle(op)
        self.agree.check((op, ()), op, note=note)

    def workers_max(self, values: np.ndarray, what: str) -> np.ndarray:
        """The elementwise maximum of `values` over every worker."""
        self._settle(what)
        return self.agree.maximum(values, what)

    def share(self, obj: Any, what: str) -> Any:
        """Rank 0's `obj` on every worker."""
        return from_rank0(self.workers, obj, what)

    def alike(self, error: str | None, what: str) -> str | None:
        """The first worker's error (in rank order), on every worker."""
        errors = to_rank0(self.workers, error, what)
        first = None if errors is None else next((e for e in errors if e is not None), None)
        return from_rank0(self.workers, first, what)
