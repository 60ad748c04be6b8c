"""The checksums an agreement sends for a call's signature: CRC-32 of its repr, kept for
the signatures a training loop repeats (every rank met the same ones, in the same order,
or an earlier agreement failed), computed each time for any other."""
from __future__ import annotations

import zlib

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gpukv.distributed.mpi import agree

signatures = st.tuples(
    st.sampled_from(["push assigning the sum", "push updating with sgd", "pull", "init"]),
    st.tuples(st.one_of(st.integers(-5, 5), st.text(max_size=4)),
              st.tuples(st.integers(0, 9), st.integers(0, 9)),
              st.sampled_from(["float32", "float16", "int64"])))


def _agreement() -> agree.Agreement:
    return agree.Agreement(transport=None)  # (the checksums need no communicator)


@given(st.lists(signatures, max_size=20))
def test_a_checksum_is_the_crc_of_the_signature_first_and_every_later_time(calls):
    a = _agreement()
    for signature in calls + calls:
        assert a._checksum(signature) == zlib.crc32(repr(signature).encode())


def test_an_unhashable_signature_is_checked_each_time():
    a = _agreement()
    signature = ("maximum", [np.int64(3)], {"keys": 2})
    assert a._checksum(signature) == zlib.crc32(repr(signature).encode())
    signature[1].append(4)  # a list may change: nothing of it was kept
    assert a._checksum(signature) == zlib.crc32(repr(signature).encode())
    assert not a._checksums


def test_the_checksums_kept_are_bounded(monkeypatch):
    monkeypatch.setattr(agree, "_CHECKSUMS_KEPT", 3)
    a = _agreement()
    for i in range(10):
        assert a._checksum(("push", (i,))) == zlib.crc32(repr(("push", (i,))).encode())
    assert list(a._checksums) == [("push", (0,)), ("push", (1,)), ("push", (2,))]


class _Ranks:
    """The one thing `_difference` asks of a transport: ranks named for a message."""

    @staticmethod
    def ranks(ranks) -> str:
        return ", ".join(map(str, ranks))


def test_a_setting_that_differs_is_named_as_a_setting_not_a_key():
    """create's agreement names the option that differs (bigarray_bound=1000), where
    keys are named as keys."""
    def create(bound):
        return (0, ("create", (agree.Setting("type", "dist_sync"),
                               agree.Setting("bigarray_bound", bound))))
    said = agree._difference(_Ranks(), {0: create(1000), 1: create(2000), 2: create(1000)})
    assert said == ("create: rank(s) 0, 2 has bigarray_bound=1000; "
                    "rank(s) 1 has bigarray_bound=2000")
    pushes = {0: (3, ("push", ("w",))), 1: (3, ("push", ("v",)))}
    assert agree._difference(_Ranks(), pushes) == \
        "push: rank(s) 0 has key 'w'; rank(s) 1 has key 'v'"
