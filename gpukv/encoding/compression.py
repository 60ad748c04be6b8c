"""Gradient compression in a one-process store: what a pushed value looks like on its way
to the key's home.

`kv.set_gradient_compression({'type': ..., ...})` picks a compressor by type name (see
`gpukv.encoding.compressors`: '2bit', '1bit', 'fp16', 'bf16'); ``None`` or
``{'type': 'none'}`` turns it off (the default). Options are numbers (or strings of
numbers, as MXNet passes them) checked in float32, the precision the kernels run in: one
that is inf there, or nonzero but below float32's smallest normal number (0 or flushed to 0
on a GPU), is refused.

Every source of a dense floating-point key is compressed, the home device's own source
too, so no device is favoured, and the updater sees the float32 sum of the trips.
Integer keys and row-sparse pushes travel uncompressed; init is never compressed, and
pull only with a compressor that compresses both ways ('sign'; MXNet's never do): then
the home keeps the value apart from what pulls read, and moves that on by one payload
after each push (`gpukv.encoding.pulls`, `serve`).

Compressors have Horovod's shape: ``compress(x, residual) -> (payload, ctx)`` and
``decompress(payload, ctx, out, accumulate=False)``, wrapped around the reduction rather
than replacing it. A compressed push is an ordinary reduce job for whichever strategy
the store picks:

    terms = comp.encode(key, sources, devices)    # one array per source, on its device
    strategy.reduce_many([ReduceJob(key, terms, devices, home, out)])
    comp.finish(key, out, home)                   # e.g. the pre_divide scale, at home

`out` is a float32 array on `home` (`comp.buffer(key, home, shape)` keeps one for keys
whose own dtype is wider). The strategies add terms of another dtype than `out` in
float32. The 'home' strategy adds them in source order (on a GPU, those it reads
directly, then those it stages), so its sum is each source's decoded value added in
turn, bit for bit; fp16 payloads are summed first and scaled once (see `Cast`).
"""
from __future__ import annotations

import numpy as np

from ..canonical.tree import leaves_sum
from .compressors import Compressor, ErrorFeedback
from .pulls import PullCodec

__all__ = ["GradientCompression"]


class GradientCompression:
    """A store's compressor plus what it keeps per (key, source device): the residuals
    of error feedback, and the buffers the sources' decoded values are written into."""

    def __init__(self, compressor: Compressor, canonical: bool = False):
        self.compressor = compressor
        #: a deterministic store's: a low-rank compressor's sums follow the canonical tree
        self.canonical = canonical
        self.feedback = ErrorFeedback(compressor)
        #: what the home does for compressed pulls (None: pulls read the values as they are)
        self.pulls = PullCodec(compressor) if compressor.compresses_pulls else None
        self._decoded: dict = {}
        self._buffers: dict = {}

    def params(self) -> dict:
        return self.compressor.params()

    def residual(self, key, device, size: int):
        """The residual of `key` on `device` (zeros the first time; None without error
        feedback); a low-rank compressor's are on the host, where its sums run."""
        if self.compressor.low_rank:
            return self.feedback.residual((key, device), size)

        def zeros(n):
            with device.activate():  # zero-filled on the stream the kernels use it on
                return device.zeros(n, np.float32)
        return self.feedback.residual((key, device), size, zeros)

    def buffer(self, key, home, shape):
        """A float32 buffer on `home` for the sum of `key`'s terms (for keys whose own
        dtype is neither float32 nor a 16-bit float, which have a merge buffer)."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tuple(shape):
            buf = home.empty(shape, np.float32)
            self._buffers[key] = buf
        return buf

    def _decoded_buffer(self, key, device, nth: int, shape):
        """The float32 buffer for the decoded value of `key`'s `nth` source on `device`
        (allocated inside the device's `activate`)."""
        slot = (key, device, nth)
        buf = self._decoded.get(slot)
        if buf is None or buf.shape != tuple(shape):
            buf = device.empty(shape, np.float32)
            self._decoded[slot] = buf
        return buf

    def reserve(self, key, sources, devices) -> None:
        """Allocate now what `encode` keeps for `key` (residuals, decoded buffers), so that
        a push short of memory fails while it is still checked, before anything moved."""
        comp = self.compressor
        seen: dict = {}
        for source, device in zip(sources, devices):
            nth = seen[device] = seen.get(device, -1) + 1
            self.residual(key, device, source.size)
            if not comp.sums_payload and not comp.low_rank:
                with device.activate():
                    self._decoded_buffer(key, device, nth, source.shape)

    def encode(self, key, sources, devices) -> list:
        """One term per source, on that source's device, for a strategy to sum into
        `key`'s float32 out at home; `finish` follows the reduction.

        Call it once every check has passed: it moves the residuals on. The terms are
        the decoded values (2bit, 1bit, bf16), kept in per-(key, device) buffers that the
        next push reuses, or the payloads themselves (fp16). Each device's work is queued
        on its stream after the caller's work on CuPy's current stream; the strategy's
        own join then orders the next push's reuse of the buffers after every read.
        """
        comp = self.compressor
        for device in dict.fromkeys(devices):
            device.enter()
        terms: list = []
        seen: dict = {}
        for source, device in zip(sources, devices):
            nth = seen[device] = seen.get(device, -1) + 1
            self.residual(key, device, source.size)  # (made where its kernels use it)
            with device.activate():  # through the feedback: it watches the residual too
                payload, ctx = self.feedback.compress((key, device), source)
                if comp.sums_payload:
                    terms.append(payload.reshape(ctx.shape))
                else:
                    decoded = self._decoded_buffer(key, device, nth, ctx.shape)
                    terms.append(comp.decompress(payload, ctx, decoded))
        return terms

    def serve(self, key, value, served, home, assigns: bool, settles: bool) -> None:
        """Compressed pulls: move `key`'s `served` value on at `home` after a push (see
        `gpukv.encoding.pulls`): from the float32 sum it `assigns`, else from `value`,
        the updated value, which becomes the served value where the optimizer `settles`
        it; the caller's current stream then sees it."""
        pulls = self.pulls
        assert pulls is not None  # a compressor that compresses pulls

        def zeros(n):
            return home.zeros(n, np.float32)
        with home.activate():
            payload = pulls.payload(key, value, served, assigns, zeros)
            pulls.apply(payload, served, assigns)
            pulls.settle(value, served, assigns, settles)
        home.leave()

    def low_rank_sum(self, key, sources, devices, home, out) -> None:
        """A low-rank compressor's push of `key` (PowerSGD; see its module): both of its
        sums over the sources, in source order (a deterministic store's: the canonical
        tree over them), on the host; their decoded sum into the float32 `out` at
        `home`, and each source's residual moved on."""
        from .compressors import powersgd
        comp = self.compressor
        assert isinstance(comp, powersgd.PowerSGD)  # the one low-rank compressor
        found = comp.matrix(out.shape)
        assert found is not None  # the plan compresses matrices only
        ms = []
        for source, device in zip(sources, devices):
            residual = self.residual(key, device, source.size)
            # now the source's M: the residual plus the source read as float32, as every
            # codec reads its values (and a dist store's leaves are)
            residual += device.to_host(source).reshape(-1).astype(np.float32, copy=False)
            ms.append(residual.reshape(found))
        add = canonical_sum if self.canonical else sum_in_order
        (total,) = powersgd.step(comp, [key], [ms], lambda lists, _: [
            add(arrays) for arrays in lists])
        home.copy(out, total.reshape(out.shape))
        home.leave()

    # ------------------------------------------------------------ snapshots
    def state(self) -> list:
        """Every piece of state that moves from push to push, as (record, array): the
        residual of each (key, source device) ({'what': 'residual', 'key', 'device':
        [kind, physical, slot]}), of each key's compressed pulls ('pull') and the
        warm-start Q of a low-rank compressor ('q'). The arrays are the live ones: copy
        them before the next push."""
        out = [({"what": "residual", "key": key, "device": [d.kind, d.physical, d.slot]}, r)
               for (key, d), r in self.feedback.residuals.items()]
        if self.pulls is not None:
            out += [({"what": "pull", "key": key}, r)
                    for key, r in self.pulls.feedback.residuals.items()]
        from .compressors import powersgd
        if isinstance(self.compressor, powersgd.PowerSGD):
            out += [({"what": "q", "key": key}, q)
                    for key, q in self.compressor.warm_starts().items()]
        return out

    def restore_residual(self, key, device, saved: np.ndarray) -> None:
        """Make `saved` (a flat float32 host array) the residual of `key` on `device`."""
        residual = self.residual(key, device, saved.size)
        if residual is None:
            return
        if self.compressor.low_rank:  # kept on the host, whatever device pushed
            np.copyto(residual, saved)
        else:
            device.copy(residual, saved)

    def restore_pull(self, key, home, saved: np.ndarray) -> None:
        """Make `saved` the residual of `key`'s compressed pulls, at `home`."""
        assert self.pulls is not None  # a compressor that compresses pulls

        def zeros(n):
            return home.zeros(n, np.float32)
        with home.activate():
            residual = self.pulls.feedback.residual(key, saved.size, zeros)
        home.copy(residual, saved)

    def restore_q(self, key, saved: np.ndarray) -> None:
        """Make `saved` the Q `key`'s next push starts from (a low-rank compressor)."""
        from .compressors import powersgd
        assert isinstance(self.compressor, powersgd.PowerSGD)
        self.compressor.keep_q(key, np.array(saved, np.float32))

    def finish(self, key, out, home) -> None:
        """The step at `home` after a strategy summed `key`'s terms into `out` (fp16 with
        a pre_divide: the scale); the caller's current stream then sees `out`."""
        comp = self.compressor
        if not comp.finishes:
            return
        with home.activate():
            comp.finish(out)
        home.leave()


def canonical_sum(arrays: list) -> np.ndarray:
    """The canonical tree's sum of `arrays` (`gpukv.canonical`), a new array."""
    return leaves_sum(arrays, np.add).copy()


def sum_in_order(arrays: list) -> np.ndarray:
    """arrays[0] + arrays[1] + ..., added in that order (a new array)."""
    total = arrays[0].copy()
    for a in arrays[1:]:
        total += a
    return total
