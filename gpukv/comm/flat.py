"""1-D contiguous views (or copies) of a job's arrays, for the kernels that walk flat memory."""
from __future__ import annotations


def flat_in(array, device):
    """A 1-D contiguous view of `array`, or a contiguous copy made on `device`."""
    if array.flags.c_contiguous:
        return array.reshape(-1)
    tmp = device.empty(array.shape, array.dtype)
    device.copy(tmp, array)
    return tmp.reshape(-1)


class FlatOut:
    """A 1-D contiguous target for `out`; `done()` copies back when it had to be a copy."""

    __slots__ = ("out", "flat", "device", "copied")

    def __init__(self, out, device):
        self.out = out
        self.device = device
        self.copied = not out.flags.c_contiguous
        self.flat = device.empty(out.size, out.dtype) if self.copied else out.reshape(-1)

    def done(self) -> None:
        if self.copied:
            self.device.copy(self.out, self.flat.reshape(self.out.shape))
