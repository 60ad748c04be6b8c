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
_NCCL = "gpukv/distributed/engines/nccl_rounds.py"
_DEVICE_TESTS = "tests/device/cuda/test_cuda_device.py::"
_LINK_TESTS = "tests/distributed/test_nccl_link.py::"
_STREAM_TESTS = "tests/emulation/test_emulated_streams.py::"

MUTATIONS = (
    Mutation(
        "slot 0 without the wait on the stream its last work went to", _DEVICE,
        """                    with self._cuda_device:
                        current.wait_event(ordering_event(used))""",
        """                    pass""",
        (_DEVICE_TESTS + "test_calls_from_other_current_streams_stay_in_call_order",
         _DEVICE_TESTS + "test_wait_for_covers_work_queued_under_a_stream_no_longer_"
         "current")),
    Mutation(
        "wait_for without the cross-stream wait_event", _DEVICE,
        """            event = other.record()
            with self._cuda_device:
                mine.wait_event(event)""",
        """            event = other.record()""",
        (_DEVICE_TESTS + "test_wait_for_orders_streams_without_host_sync",)),
    Mutation(
        "enter without its wait", _DEVICE,
        """                    marks[self.physical] = event
            self.stream.wait_event(event)""",
        """                    marks[self.physical] = event""",
        ("tests/store/test_gpu_store.py::test_tutorial_several_arrays_on_one_gpu",)),
    Mutation(
        "leave without its wait", _DEVICE,
        """            current.wait_event(event)""",
        """            pass""",
        (_DEVICE_TESTS + "test_wait_for_orders_streams_without_host_sync",)),
    Mutation(
        "leave of slot 0 without following a new current stream", _DEVICE,
        """            self.stream  # noqa: B018 (the property orders a new current stream)
            return""",
        """            return""",
        ("tests/store/test_gpu_store.py::test_a_pull_into_the_adopted_value_under_another_"
         "stream_follows_the_push",)),
    Mutation(
        "wait_event a no-op", _DEVICE,
        """        with self._cuda_device:
            self.stream.wait_event(event)""",
        """        return""",
        ("tests/comm/test_strategies.py::test_gpu_many_keys_one_call[ring]",)),
    Mutation(
        "NcclLink.run without enter", _NCCL,
        """        device.enter()
        with device.cuda_device:""",
        """        with device.cuda_device:""",
        (_LINK_TESTS + "test_a_link_on_a_virtual_gpu_orders_the_callers_work",)),
    Mutation(
        "NcclLink.run without the completion poll", _NCCL,
        """            self.t.poll(lambda: True if stream.done else None, what,
                        on_timeout=self._abort(what))""",
        """            pass""",
        (_LINK_TESTS + "test_a_collective_that_never_completes_times_out_and_"
         "aborts",)),
    Mutation(
        "pinned tables handed out again while their copies are in flight",
        "gpukv/device/cuda/kernels.py",
        """                if event.done:""",
        """                if True:""",
        (_STREAM_TESTS + "test_a_pinned_table_is_not_reused_while_its_copy_is_in_flight",)),
    Mutation(
        "keep_alive past the pinned cap without waiting", _DEVICE,
        """        oldest.synchronize()""",
        """        pass""",
        (_STREAM_TESTS + "test_past_the_pinned_cap_the_host_waits_for_the_oldest_copies",)),
    Mutation(
        "the host strategy's broadcast without enter", "gpukv/comm/host.py",
        """                device.enter()
                device.copy(out, src)""",
        """                device.copy(out, src)""",
        ("tests/store/test_gpu_store.py::test_tutorial_several_arrays_on_one_gpu",)),
    Mutation(
        "an assigned push without leave", "gpukv/store/pipeline.py",
        """        for home in assigned:  # the caller's current stream sees the new values
            home.leave()""",
        """        pass""",
        ("tests/encoding/test_compression_gpu.py::test_store_on_gpus_equals_the_host_store"
         "[1bit-0-8]",)),
    Mutation(
        "LAMB without the lower bound of the weight norm", "gpukv/device/cuda/optim_kernels.py",
        """    r1 = fmaxf(r1, (float)hp[5]);""",
        """    (void)0;""",
        ("tests/optim/test_optim_gpu.py::test_gpu_steps_equal_the_host_twin"
         "[lamb_lower_bound-float32]",)),
)


#: edits no test can notice, and why
EQUIVALENT = (
    Mutation(
        "NcclLink.run without leave", _NCCL,
        """        device.leave()

    def _abort""",
        """
    def _abort""",
        ()),
    # Its completion poll already makes the host wait until the stream has run the group;
    # whatever the host issues afterwards, on any stream, comes after it, so the event
    # `leave` makes the caller's stream wait for orders nothing more.
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
