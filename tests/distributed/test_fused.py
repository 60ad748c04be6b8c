"""A small sum carrying its agreement (`gpukv.distributed.mpi.fused`): the stamps' sums
tell whether every rank sent the one foretold, and the forecast foretells a call only
after the same call followed the last one twice in a row. The rounds themselves run in
several processes (`test_dist_store.py`, the `fused_rounds` scenario)."""
from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gpukv.distributed.mpi import fused

checksums = st.integers(0, 2**32 - 1)


@given(st.lists(st.sampled_from([0, 1, 0xFFFFFFFF, 0x12345678, 0x12345679]),
                min_size=1, max_size=70),
       checksums, st.sampled_from(sorted(fused.FUSIBLE, key=str)))
def test_the_summed_stamps_say_whether_every_rank_sent_the_one_asked(sent, asked, dtype):
    """Stamps that differ in one digit, or that sum to the same total (1 + 3 == 2 + 2 in
    a digit), are told apart: only every rank's sending `asked` passes."""
    stamps = fused.Stamps(len(sent))
    buffers = np.zeros((len(sent), fused.STAMP + 3), dtype)
    for row, crc in zip(buffers, sent):
        stamps.write(row, crc)
    sums = buffers.sum(axis=0, dtype=dtype)
    for crc in {asked, sent[0]}:
        assert stamps.sent_by_all(sums, crc) == all(c == crc for c in sent)


def test_digits_that_sum_alike_are_not_taken_for_equal():
    """Two ranks whose digits are 1 and 3 sum as two ranks' 2 and 2 would; the squares
    tell them apart (a check of the digits' sums alone would pass)."""
    stamps = fused.Stamps(2)
    one, three, two = (np.zeros(fused.STAMP, np.float32) for _ in range(3))
    stamps.write(one, 0x1)
    stamps.write(three, 0x3)
    stamps.write(two, 0x2)
    assert np.array_equal((one + three)[:8], (two + two)[:8])
    assert not stamps.sent_by_all(one + three, 0x2)
    assert stamps.sent_by_all(two + two, 0x2)


def _foretold(calls: list, specs: dict, i: int):
    """The rule in plain words: before call `i`, look at what followed each earlier call
    equal to the last one; when the last two such followers are one call, and it is a
    fused sum, that call is foretold."""
    last = calls[i - 1] if i else None
    followers = [calls[j] for j in range(i) if (calls[j - 1] if j else None) == last]
    if len(followers) >= 2 and followers[-1] == followers[-2] \
            and specs[followers[-1]] is not None:
        return followers[-1], specs[followers[-1]]
    return None


@given(st.lists(st.integers(0, 4), max_size=60), st.sets(st.integers(0, 4)))
def test_the_forecast_follows_its_rule(calls, plain):
    """Calls 0-4, those in `plain` no fused sum: the forecast before every call is the
    rule's (`_foretold`)."""
    specs = {c: None if c in plain else (np.dtype(np.float32), c + 1) for c in range(5)}
    forecast = fused.Forecast()
    for i, call in enumerate(calls):
        assert forecast.guess() == _foretold(calls, specs, i), (calls[:i], call)
        forecast.learn(call, specs[call])


def test_a_repeated_call_is_foretold_from_its_fourth_time_and_a_change_stops_it():
    forecast, spec = fused.Forecast(), (np.dtype(np.float32), 1024)
    seen = []
    for call in ["a", "a", "a", "a", "b", "a", "a"]:
        seen.append(forecast.guess())
        forecast.learn(call, spec)
    assert seen == [None, None, None, ("a", spec), ("a", spec), None, None]


def test_a_full_forecast_starts_afresh_and_learns_the_loop_again(monkeypatch):
    """A job that makes ever new calls (a new key each step) fills the forecast: it is
    emptied, alike on every rank, so a loop after them is foretold again."""
    monkeypatch.setattr(fused, "_KEPT", 3)
    forecast, spec = fused.Forecast(), (np.dtype(np.float32), 4)
    for call in range(10):
        forecast.learn(call, spec)
    seen = []
    for _ in range(5):
        seen.append(forecast.guess())
        forecast.learn("loop", spec)
    assert seen[3:] == [("loop", spec), ("loop", spec)], seen


def test_only_small_sums_of_exact_dtypes_are_fused():
    assert fused.fusible(np.float32, 1024)
    assert fused.fusible(np.int64, fused.FUSE_BYTES // 8)
    assert not fused.fusible(np.float32, fused.FUSE_BYTES // 4 + 1)
    assert not fused.fusible(np.float16, 8)  # exact integers end at 2048: 10 ranks' squares
    assert not fused.fusible(np.uint8, 8)
    assert not fused.fusible(np.float32, 0)
