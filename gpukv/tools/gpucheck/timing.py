"""GPU time per call, from CUDA events around back-to-back calls on a device's stream."""
from __future__ import annotations

import statistics

BATCHES = 3


def seconds_per_call(device, call, iters: int, batches: int = BATCHES) -> float:
    """The median over `batches` batches of `iters` calls of `call()`, queued with
    `device` (a CudaDevice) active, after one untimed call (compiles, allocations)."""
    from ...device.cuda.timing import clock_for_devices
    clock = clock_for_devices([device])
    with device.activate():
        call()
        device.synchronize()
        pairs = []
        for _ in range(batches):
            start = clock.start()
            for _ in range(iters):
                call()
            pairs.append((start, clock.stop()))
    times = clock.elapsed(pairs)
    device.synchronize()
    return statistics.median(times) / iters
