"""Agreement before a collective call: every process says what it is about to do, and
everyone learns whether all said the same, each wait bounded.

The collectives that follow cannot hang on a process that is elsewhere in the program:
the ranks that did not arrive, or that call something else (another key, shape or dtype),
are named in the PeerError every rank raises. On a store's own communicator the check is
one nonblocking allreduce (MAX) of each rank's digest and its negation: all agree when the
maximum is also the minimum. Only when it does not finish in time does rank 0 call the
roll (the ranks waiting answer; the others are named); once rank 0's program has ended,
the first rank whose program has not calls it in its place, without waiting out the
timeout. Only when digests differ do the whole descriptions travel to rank 0. A small
sum every rank can foretell carries its agreement inside itself instead (`fused`). On a
communicator the program shares (the agreement of `create`, on COMM_WORLD) no collective
is issued: each rank sends rank 0 its digest and waits for the verdict.
"""
from __future__ import annotations

import pickle
import time
import typing
import zlib

import numpy as np

from ... import timeline
from ..._errors import ArgumentError, PeerError, PeerMismatchError
from . import job_exit
from .fused import STAMP, Buffers, Forecast, FusedSum, Stamps
from .transport import TAG_DIGEST, TAG_ROLL, TAG_SHARE, TAG_SIGNATURE, TAG_VERDICT, Transport

_OK = ("ok", "")
_MISMATCH = ("mismatch", "")


#: seconds an agreement waits before it also listens for rank 0's roll call and verdict
#: (which come only once rank 0 has waited out its timeout)
_HEAR_AFTER = 0.01
#: seconds a call still waits once rank 0's word that its program ended is seen, before it
#: is named as ended without making the call (capped at a quarter of the timeout): a rank
#: 0 that made the call and then ended sent its part of it before that word, which can
#: overtake it (another communicator's message)
_ENDED_GRACE = 1.0
#: signatures whose checksums an agreement keeps (beyond them, each is computed anew)
_CHECKSUMS_KEPT = 4096


class Setting(typing.NamedTuple):
    """An item of a call that is an option, not a key: named `name`=`value` in errors."""
    name: str
    value: typing.Any


class Agreement:
    """Numbers the collective calls of one communicator and checks each one."""

    def __init__(self, transport: Transport, tags: int = 0, collective: bool = True):
        self.t = transport
        self.seq = 0
        self.collective = collective
        # its message tags: TAG_DIGEST, TAG_VERDICT, TAG_SIGNATURE and TAG_ROLL, moved by
        # `tags`
        self.digest_tag, self.verdict_tag, self.signature_tag, self.roll_tag = (
            TAG_DIGEST + tags, TAG_VERDICT + tags, TAG_SIGNATURE + tags, TAG_ROLL + tags)
        #: the checksums of the signatures met so far (a training loop repeats a few)
        self._checksums: dict = {}
        # the buffers of the collective agreement, reused: each call waits for its own
        # collective to finish before it returns, and a failed transport is never used
        self._extremes = np.empty(4, np.int64)
        self._mine = np.empty(4, np.int64)
        #: the next call, foretold alike on every rank (when it is a fused sum)
        self._forecast = Forecast()
        self._fused_buffers = Buffers()
        self._stamps = Stamps(transport.size if transport is not None else 1)

    def check(self, signature: tuple, what: str, alongside=None,
              fused: FusedSum | None = None, note: str | None = None):
        """Return once every rank called the same thing (`signature`, a tuple of plain
        values naming the call); else raise PeerError/PeerMismatchError on every rank.

        `note`, if given, is said beside this rank's call where a disagreement names it
        (the words of a refusal: "push refused (ShapeError): key 3: ..."), and is not
        compared: ranks whose signatures are alike agree whatever their notes say.

        `alongside()`, if given, starts the call's own collectives, and what it returns
        (their requests) is returned. On the store's communicator it runs right after
        the agreement's own collective is posted, so that both travel together (every
        rank posts them in the same order; when the agreement fails, the failure is
        raised and the transport, failed, never waits on them).

        `fused`, if given, is the call's sum when it is small (`fused.FusedSum`): once the
        ranks' calls foretell it, the agreement travels inside it, and what `fused.take`
        returns is returned instead (`alongside` is not called)."""
        with timeline.span("agree", "mpi", call=what):
            return self._check(signature, what, alongside, fused, note)

    def _check(self, signature: tuple, what: str, alongside, fused=None, note=None):
        t = self.t
        t.check()
        self.seq += 1
        if t.size == 1:
            return alongside() if alongside is not None else None
        crc = self._checksum(signature)
        if self.collective:
            spec = fused.spec if fused is not None else None
            guess = self._forecast.guess()
            if guess is not None:
                taken = self._fused(crc, guess, fused, what)
                if taken is not None:
                    self._forecast.learn(crc, spec)
                    return taken
            started = self._together(crc, signature, what, alongside, note)
            self._forecast.learn(crc, spec)
            return started
        digest = np.array([self.seq, crc], dtype=np.int64)
        if t.rank == 0:
            self._coordinate(digest, signature, what, note)
        else:
            self._follow(digest, signature, what, note)
        return alongside() if alongside is not None else None

    def _checksum(self, signature: tuple) -> int:
        """CRC-32 of the signature's repr, the same on every rank for the same call. (Every
        earlier call agreed, so every rank met the same signatures in the same order and
        keeps the same checksums.)"""
        try:
            crc = self._checksums.get(signature)
        except TypeError:  # not hashable: computed each time
            return zlib.crc32(repr(signature).encode())
        if crc is None:
            crc = zlib.crc32(repr(signature).encode())
            if len(self._checksums) < _CHECKSUMS_KEPT:
                self._checksums[signature] = crc
        return crc

    def maximum(self, values: np.ndarray, what: str) -> np.ndarray:
        """The elementwise maximum of `values` (int64, one shape) over every rank, each
        of which calls it at the same point (checked first, as every call is)."""
        self.check(("maximum", values.shape), what)
        if self.t.size == 1:
            return values.copy()
        out = np.empty_like(values)
        self.wait([self.t.comm.Iallreduce(values, out, op=self.t.MPI.MAX)], what)
        return out

    def wait(self, requests: list, what: str) -> None:
        """Complete `requests`, a collective every rank started after this round's check:
        when it does not finish in time, every rank raises a PeerError naming the ranks
        that are not waiting in it (rank 0 calls the roll, as for an agreement)."""
        if not requests:
            return
        if self.t.rank == 0:
            self.t.wait_all(requests, what, on_timeout=lambda: self._roll_call(what))
        else:
            self._wait_or_hear(requests, what)

    # ------------------------------------------------ on the store's communicator
    def _fused(self, crc: int, guess: tuple, fused: FusedSum | None, what: str):
        """The foretold sum, stamped with each rank's checksum (`fused`): what
        `fused.take` returns when every rank made the foretold call, else None, on every
        rank alike (they then agree the usual way). A rank whose call is another still
        posts the foretold sum, stamped as no rank making that call stamps."""
        t = self.t
        foretold = guess[0]
        made = fused if fused is not None and crc == foretold and fused.spec == guess[1] \
            else None
        stamped = foretold if made is not None else foretold ^ 0xFFFFFFFF
        send, sums = self._fused_buffers.of(guess[1])
        self._stamps.write(send, stamped)
        if made is not None:
            made.fill(send[STAMP:])
        else:
            send[STAMP:] = 0
        self.wait([t.comm.Iallreduce(send, sums, op=t.MPI.SUM)], what)
        if made is not None and self._stamps.sent_by_all(sums, stamped):
            return made.take(sums[STAMP:])
        return None

    def _together(self, crc: int, signature, what, alongside, note=None):
        t = self.t
        seq, mine, extremes = self.seq, self._mine, self._extremes
        mine[0], mine[1], mine[2], mine[3] = seq, crc, -seq, -crc
        request = t.comm.Iallreduce(mine, extremes, op=t.MPI.MAX)
        started = alongside() if alongside is not None else None
        self.wait([request], what)
        high_seq, high_crc, low_seq, low_crc = extremes.tolist()
        if high_seq == -low_seq and high_crc == -low_crc:  # the largest is the smallest
            return started
        calls = to_rank0(t, (self.seq, signature, note), what)  # every rank is here
        message = None
        if calls is not None:
            message = (f"{what}: processes disagree: {_told(t, dict(enumerate(calls)))}"
                       f"{_workers_are(t)}")
        raise t.fail(PeerMismatchError(from_rank0(t, message, what)))

    def _roll_call(self, what: str, answer_within: float | None = None) -> PeerError:
        """Rank 0, when the agreement (or the collective after it) did not finish in time,
        or the rank standing in for it (`_caller`): ask who is waiting in it; the ranks
        that do not answer within `answer_within` seconds are the missing ones. The others
        hear the verdict."""
        t = self.t
        others = range(t.rank + 1, t.size)  # (the ranks before a stand-in have ended)
        t.wait_all([t.send_object(self.seq, r, self.roll_tag) for r in others],
                   f"{what}: calling the roll", timeout=t.timeout)
        here = np.zeros(t.size, np.int64)
        here[t.rank] = self.seq
        answers = [t.recv_array(here[r:r + 1], r, self.roll_tag) for r in others]
        # A rank waiting in the agreement answers at once; the others wait a while longer
        # for the verdict than rank 0 waited for them (see `_wait_or_hear`).
        t.settle(answers, min(2.0, t.timeout / 4) if answer_within is None
                 else answer_within)
        return self._absent([r for r in range(t.size) if here[r] != self.seq], what)

    def _absent(self, late: list, what: str) -> PeerError:
        """Rank 0 (or its stand-in), after a timeout: the PeerError naming the `late`
        ranks, told to the others."""
        t = self.t
        arrived = [r for r in range(t.size) if r not in late]
        ended = [r for r in late if job_exit.ended(t.job_rank(r))]
        missing = [_ended(t, ended)] if ended else []
        waited = [r for r in late if r not in ended]
        if waited:
            missing.append(f"rank(s) {t.ranks(waited)} did not arrive within "
                           f"{t.timeout:g} s (GPUKV_DIST_TIMEOUT)")
        message = f"{what}: {'; '.join(missing)}; rank(s) {t.ranks(arrived)} did"
        if not late:  # (a transfer that stopped, all of its ranks waiting)
            message = (f"{what}: every rank is in it, and it did not finish within "
                       f"{t.timeout:g} s (GPUKV_DIST_TIMEOUT)")
        self._tell([r for r in arrived if r != t.rank], ("peer", message))
        return PeerError(message)

    def _caller(self) -> int:
        """Who calls the roll: rank 0, or once its program has ended (it will never come),
        the first rank whose program has not; every rank finds the same one (an exit's
        word stays)."""
        t = self.t
        for r in range(t.size):
            if not job_exit.ended(t.job_rank(r)):
                return r
        return 0

    def _wait_or_hear(self, requests: list, what: str) -> None:
        """A rank but 0: wait for `requests`, answering the roll call, until done or the
        verdict (longer than rank 0 waits, so that its verdict comes first). The roll is
        rank 0's, or when rank 0's program has ended, its stand-in's (`_caller`): this
        rank's own when that is this rank (after `_ended_grace`, not the timeout)."""
        t = self.t
        test_all = t.MPI.Request.Testall
        anyone = t.MPI.ANY_SOURCE  # (rank 0, or its stand-in)
        start = time.monotonic()
        grace, ended_for = _ended_grace(t), _Since()

        def done():
            if test_all(requests):
                return True
            waited = time.monotonic() - start
            if waited < _HEAR_AFTER:  # rank 0 calls only after a timeout
                return None
            roll = t.try_recv_object(anyone, self.roll_tag)
            if roll is not None:
                seq, caller = roll
                t.wait_all([t.send_array(np.array([seq], np.int64), caller,
                                         self.roll_tag)],
                           f"{what}: answering the roll", timeout=t.timeout)
            verdict = t.try_recv_object(anyone, self.verdict_tag)
            if verdict is not None:
                kind, message = verdict[0]
                raise t.fail((PeerMismatchError if kind == "mismatch" else PeerError)(
                    message))
            if self._caller() == t.rank and ended_for(time.monotonic()) > grace:
                # the ranks still to come get what is left of the timeout; those here
                # answer at once
                raise t.lost(self._roll_call(
                    what, max(t.timeout - waited, min(2.0, t.timeout / 4))))
            return None

        def silent() -> PeerError:
            caller = self._caller()
            ended = _ended(t, range(caller)) + "; " if caller else ""
            return PeerError(
                f"{what}: {ended}rank {t.job_rank(t.rank)} waited {patience:g} s for the "
                f"others, and rank {t.job_rank(caller)}, which names the ranks that did "
                f"not arrive once its own {t.timeout:g} s have passed, said nothing: rank "
                f"{t.job_rank(caller)} did not arrive, or cannot be reached "
                f"(GPUKV_DIST_TIMEOUT)")
        patience = t.timeout * 1.5 + 2
        t.poll(done, what, timeout=patience, on_timeout=silent)

    # ----------------------------------------------------------------- rank 0
    def _coordinate(self, digest, signature, what, note=None) -> None:
        t = self.t
        others = range(1, t.size)
        digests = {r: np.zeros(2, np.int64) for r in others}
        requests = {r: t.recv_array(digests[r], r, self.digest_tag) for r in others}

        def missing():
            return self._absent([r for r, req in requests.items() if not t.done([req], what)],
                                what)
        t.wait_all(list(requests.values()), what, on_timeout=missing)
        if all(np.array_equal(d, digest) for d in digests.values()):
            self._tell(others, _OK)
            return
        self._tell(others, _MISMATCH)
        calls = {0: (self.seq, signature, note)}
        for r in others:
            calls[r], _ = t.recv_object(r, self.signature_tag,
                                        f"{what}: rank {t.job_rank(r)}'s call")
        message = f"{what}: processes disagree: {_told(t, calls)}{_workers_are(t)}"
        self._tell(others, ("mismatch", message))
        raise t.fail(PeerMismatchError(message))

    def _tell(self, ranks, verdict) -> None:
        t = self.t
        t.wait_all([t.send_object(verdict, r, self.verdict_tag) for r in ranks],
                   "sending the verdict of a collective call")

    # ------------------------------------------------------------- other ranks
    def _follow(self, digest, signature, what, note=None) -> None:
        t = self.t
        # rank 0 waits `timeout` for the others before it answers: wait longer than that
        patience = t.timeout * 1.5 + 1
        t.wait_all([t.send_array(digest, 0, self.digest_tag)], f"{what}: reaching rank 0",
                   timeout=patience)
        verdict = self._verdict(what, patience)
        if verdict == _MISMATCH:
            t.wait_all([t.send_object((self.seq, signature, note), 0, self.signature_tag)],
                       f"{what}: reaching rank 0", timeout=patience)
            verdict = self._verdict(what, patience)
        kind, message = verdict
        if kind == "ok":
            return
        error = PeerMismatchError if kind == "mismatch" else PeerError
        raise t.fail(error(message))

    def _verdict(self, what: str, patience: float):
        """Rank 0's verdict, or PeerError soon after rank 0's program has ended (no
        verdict will come)."""
        t = self.t
        grace, ended_for = _ended_grace(t), _Since()

        def heard():
            got = t.try_recv_object(0, self.verdict_tag)
            if got is None and job_exit.ended(t.job_rank(0)) and \
                    ended_for(time.monotonic()) > grace:
                raise t.fail(PeerError(f"{what}: {_ended(t, [0])}"))
            return got
        return t.poll(heard, f"{what}: waiting for rank 0", timeout=patience)[0]


def _ended_grace(t: Transport) -> float:
    """Seconds a rank waits on once rank 0's word at exit is seen (`_ENDED_GRACE`)."""
    return min(_ENDED_GRACE, t.timeout / 4)


class _Since:
    """`since(now)`: the seconds since the first call (0 on that call)."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, now: float) -> float:
        if self.first is None:
            self.first = now
        return now - self.first


def _ended(t: Transport, ranks) -> str:
    """The words for `ranks`, whose programs ended before a call they did not make."""
    return (f"rank(s) {t.ranks(ranks)} ended (reached the program's end or sys.exit) "
            f"without making this call")


def _told(t: Transport, calls: dict) -> str:
    """`_difference` of what each rank sent: {rank: (seq, signature, note)}."""
    return _difference(t, {r: c[:2] for r, c in calls.items()},
                       {r: c[2] for r, c in calls.items()})


def _difference(t: Transport, signatures: dict, notes: dict | None = None) -> str:
    """What the ranks call, at the first place where some rank's call differs from rank
    0's, with the ranks grouped by what they call there. `notes`: {rank: words said
    beside its call, or None} (see `Agreement.check`), added where a call is named."""
    first = signatures[0]
    other = next(r for r in sorted(signatures) if signatures[r] != first)
    seq0, (op0, items0) = first
    seq, (op, items) = signatures[other]
    calls = {r: (*s, (notes or {}).get(r)) for r, s in signatures.items()}
    if seq != seq0:
        return _grouped(t, calls,
                        lambda c: f"at collective call #{c[0]} ({_call(c[1], c[2])})")
    if op != op0:
        return _grouped(t, calls, lambda c: f"calls {_call(c[1], c[2])}")
    at = next((i for i, (a, b) in enumerate(zip(items0, items)) if a != b),
              min(len(items0), len(items)))

    def item(s):
        found = s[1][1]
        return f"has {_item(found[at])}" if at < len(found) else "has nothing more"
    return f"{op0}: " + _grouped(t, signatures, item)


def _grouped(t: Transport, signatures: dict, describe) -> str:
    groups: dict = {}
    for rank in sorted(signatures):
        groups.setdefault(describe(signatures[rank]), []).append(rank)
    return "; ".join(f"rank(s) {t.ranks(ranks)} {what}" for what, ranks in groups.items())


def _workers_are(t: Transport) -> str:
    """How a disagreement's ranks (the job's) map to workers, where they differ: the
    servers of a job are its first ranks."""
    return f" (worker W is rank {t.first_rank}+W of the job)" if t.first_rank else ""


def _call(signature, note: str | None = None) -> str:
    """A call's signature in words: (op, (key, (key, shape, dtype) or (key, count), ...)),
    then the `note` said beside it."""
    op, items = signature
    said = f": {note}" if note is not None else ""
    if not items:
        return op + said
    shown = ", ".join(_item(i) for i in items[:4]) + (" ..." if len(items) > 4 else "")
    return f"{op} of {shown}{said}"


def _item(item) -> str:
    """An item of a call: a key, (key, shape, dtype), (key, values pushed of it), or a
    Setting."""
    if isinstance(item, Setting):
        return f"{item.name}={item.value!r}"
    if isinstance(item, tuple) and len(item) == 2:
        key, count = item
        return f"key {key!r} with {count} value(s) pushed"
    if isinstance(item, tuple):
        key, shape, dtype = item
        return f"key {key!r} {tuple(shape)} {dtype}"
    return f"key {item!r}"


def from_rank0(t: Transport, obj, what: str):
    """Rank 0's `obj` on every rank (each wait bounded). Rank 0 may take long to make it
    (a checkpoint read, calls to servers): the others wait twice the timeout.

    It is pickled once and the same bytes go to every rank (a whole checkpoint can be
    shared this way without a copy per rank): first their length, then the bytes."""
    if t.size == 1:
        return obj
    patience = 2 * t.timeout + 1
    if t.rank == 0:
        blob = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        requests = []
        for r in range(1, t.size):
            requests += [t.send_object(blob.size, r, TAG_SHARE),
                         t.send_array(blob, r, TAG_SHARE)]
        t.wait_all(requests, f"{what}: sending to the other ranks", timeout=patience)
        return obj
    size, _ = t.recv_object(0, TAG_SHARE, f"{what}: waiting for rank 0", timeout=patience)
    blob = np.empty(size, np.uint8)
    t.wait_all([t.recv_array(blob, 0, TAG_SHARE)], f"{what}: receiving from rank 0",
               timeout=patience)
    return pickle.loads(blob.data)


def optimizer_named(name: str, settings: tuple) -> str:
    """An optimizer as an agreement names it: its plain options in words, so that a
    worker whose learning rate or batch size (rescale_grad) differs sees which; the
    rest (per-key multipliers, options that are no plain value) by a checksum."""
    options, lr_mult, wd_mult = settings
    plain = (bool, int, float, str, type(None))
    words = ", ".join(f"{k}={v!r}" for k, v in options if isinstance(v, plain))
    rest = ([(k, v) for k, v in options if not isinstance(v, plain)], lr_mult, wd_mult)
    return (f"{name}({words})" if not any(rest)
            else f"{name}({words}) #{zlib.crc32(repr(rest).encode()):08x}")


def refuse_split(optimizer, layouts: dict, over: str) -> None:
    """ArgumentError naming a split key when `optimizer` needs whole keys (LAMB: its norms
    are per key); `layouts`: {key: KeyLayout}, the keys it would run or the keys about to
    be made."""
    if not getattr(optimizer, "per_key_norms", False):
        return
    for key, layout in layouts.items():
        if layout.split:
            raise ArgumentError(
                f"key {key!r}: {optimizer.name} needs each key whole (its norms are per "
                f"key), but this key of {layout.size} elements is split over "
                f"{over}; raise bigarray_bound above its size")


def to_rank0(t: Transport, obj, what: str):
    """Every rank's `obj`, as a list on rank 0 (None elsewhere), each wait bounded."""
    if t.size == 1:
        return [obj]
    if t.rank != 0:
        t.wait_all([t.send_object(obj, 0, TAG_SHARE)], f"{what}: sending to rank 0",
                   timeout=2 * t.timeout + 1)
        return None
    got = [obj]
    for r in range(1, t.size):
        got.append(t.recv_object(r, TAG_SHARE, f"{what}: waiting for rank {t.job_rank(r)}",
                                 timeout=2 * t.timeout + 1)[0])
    return got
