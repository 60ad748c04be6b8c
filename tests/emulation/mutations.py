"""Edits to gpukv's sources that the test suite must notice, and how to apply one to a
copy of the package.

Each is an exact piece of source text and what replaces it: a wait for another stream
deleted, or a bound of the LAMB kernel dropped. `test_mutations.py` applies each to a
copy of gpukv in a temporary folder and runs the tests named for it there.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str      # relative to the checkout
    old: str       # exact text, found once
    new: str
    tests: tuple   # pytest node ids (or files) of which at least one must fail


_DEVICE = "gpukv/device/cuda/device.py"
_NCCL = "gpukv/distributed/nccl_rounds.py"
_STRATEGIES = "tests/comm/test_gpu_store_matrix.py"

MUTATIONS = (
    Mutation(
        "wait_for without the wait on the previous stream", _DEVICE,
        """            with self._cuda_device:
                mine.wait_event(last[0])""",
        """            pass""",
        ()),
    Mutation(
        "wait_for without the cross-stream wait_event", _DEVICE,
        """            event = other.record()
            with self._cuda_device:
                mine.wait_event(event)""",
        """            event = other.record()""",
        ()),
    Mutation(
        "enter without its wait", _DEVICE,
        """                self.stream.wait_event(ordering_event(current))""",
        """                ordering_event(current)""",
        ()),
    Mutation(
        "leave without its wait", _DEVICE,
        """                current.wait_event(event)""",
        """                pass""",
        ()),
    Mutation(
        "wait_event a no-op", _DEVICE,
        """        with self._cuda_device:
            self.stream.wait_event(event)""",
        """        return""",
        ()),
    Mutation(
        "NcclLink.run without enter", _NCCL,
        """        device.enter()
        with device.cuda_device:""",
        """        with device.cuda_device:""",
        ()),
    Mutation(
        "NcclLink.run without leave", _NCCL,
        """        device.leave()

    def _abort""",
        """
    def _abort""",
        ()),
    Mutation(
        "NcclLink.run without the completion poll", _NCCL,
        """            self.t.poll(lambda: True if stream.done else None, what,
                        on_timeout=self._abort(what))""",
        """            pass""",
        ()),
    Mutation(
        "LAMB without the lower bound of the weight norm", "gpukv/device/cuda/optim_kernels.py",
        """    r1 = fmaxf(r1, (float)hp[5]);""",
        """    (void)0;""",
        ()),
)


def apply(mutation: Mutation, into: Path) -> Path:
    """A copy of the `gpukv` package under `into` with `mutation` made; `into` is what
    goes first on PYTHONPATH."""
    target = into / "gpukv"
    shutil.copytree(ROOT / "gpukv", target,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    path = into / mutation.path
    text = path.read_text()
    if text.count(mutation.old) != 1:
        raise AssertionError(f"{mutation.name}: the text to edit is not found once in "
                             f"{mutation.path}")
    path.write_text(text.replace(mutation.old, mutation.new))
    return into
