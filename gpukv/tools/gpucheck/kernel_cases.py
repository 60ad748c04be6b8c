"""The kernel cases gpucheck compares bit for bit: every CUDA kernel gpukv launches, on
fixed inputs, through the same device-layer calls the store makes.

A case builds its inputs from a seed of its own name (NumPy's generator, so they are the
same on every machine), puts them on a device (a GPU, or the host for the NumPy twins),
runs the kernel, and returns its outputs as NumPy arrays. Float inputs carry special
values at fixed places: signed zeros, subnormals, the smallest normal, infinities, NaNs
with payloads (quiet and signalling), the largest finite value and float16's rounding
edges, so that flush-to-zero and NaN handling show in the outputs.

Families: the fused k-way sum (`sum_into`, every dtype pair the store makes), the
canonical tree sum (`tree_sum_into`), the copy/cast kernel (`copy_many`), the row-sparse
run sum (`segment_sum`), the compression codecs (2-bit, 1-bit, fp16, bf16: encode, decode,
decode-and-add) and every optimizer's step (each rule and option set, float32, float16,
bfloat16 and float64 weights, dense and lazy row-sparse), weights, states and master
copies all compared. LAMB keys stay within one block of its kernel: its norms are summed
across blocks by atomic adds, whose order a GPU does not fix.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...device.base import Device, Term

#: elements of most cases: three blocks of 4096 and a tail
N = 3 * 4096 + 77
#: a key of one LAMB/optimizer block (optim_kernels.CHUNK elements)
OPT_N = 8192


def bfloat16():
    """NumPy's bfloat16 (ml_dtypes), or None where ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


#: bit patterns placed among float inputs, per dtype
SPECIAL_BITS = {
    "float32": [0x00000000, 0x80000000, 0x00000001, 0x806CE3EE, 0x00800000, 0x80800000,
                0x7F800000, 0xFF800000, 0x7FC00001, 0xFFC0DEAD, 0x7F800123, 0x7F7FFFFF,
                0x477FE000, 0x477FF000, 0x33800000, 0x3F800800],
    "float16": [0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x7C00, 0xFC00, 0x7E01, 0xFE55,
                0x7C01, 0x7BFF, 0x3C01],
    "bfloat16": [0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x7F80, 0xFF80, 0x7FC1, 0xFFD5,
                 0x7F81, 0x7F7F, 0x3F81],
    # no float64 subnormals: the emulation's CPU flushes them (DAZ/FTZ) where a GPU keeps
    # them, and what follows from that in later arithmetic is no documented exception.
    # The last four: 1 + 2**-11 + 2**-52 and 2**-25 (1 + 2**-52), which round to float16
    # differently in one rounding (as NumPy casts) and through float32; -(1 + 2**-8 +
    # 2**-52), which ml_dtypes rounds to bfloat16 through float32; 2**-130 (1 + 2**-52), a
    # float32 (and bfloat16) subnormal once converted
    "float64": [0x0, 0x8000000000000000, 0x7FF0000000000000, 0xFFF0000000000000,
                0x7FF8000000000001, 0xFFF800000000DEAD, 0x7FF0000000000123,
                0x7FEFFFFFFFFFFFFF, 0x3FF0000000000001, 0x3FF0020000000001,
                0x3E60000000000001, 0xBFF0100000000001, 0x37D0000000000001],
}
SPECIAL_SHARE = 0.03  # of the elements of a float input


class Stream:
    """The inputs of one case: raw 64-bit words of PCG64 seeded by the case's name, turned
    into values with integer and exact float arithmetic only. NumPy keeps a bit
    generator's raw stream fixed across versions, which its distributions (normal,
    choice) are not bound to, and SIMD logarithms differ between CPUs: the goldens must
    describe the same inputs on every machine."""

    def __init__(self, name: str):
        self.bits = np.random.PCG64(zlib.crc32(name.encode()))

    def raw(self, n: int) -> np.ndarray:
        return self.bits.random_raw(n)

    def distinct(self, k: int, n: int, low: int = 0) -> np.ndarray:
        """k distinct ints of [low, n), in the order first drawn."""
        picked: list = []
        seen: set = set()
        while len(picked) < k:
            for v in (self.raw(4 * k) % np.uint64(n - low)).tolist():
                if v not in seen:
                    seen.add(v)
                    picked.append(v + low)
                    if len(picked) == k:
                        break
        return np.array(picked, np.int64)

    def floats(self, n: int, scale: float = 1.0) -> np.ndarray:
        """float32 values in [-scale, scale) times a power of two from 1/64 to 2: spread
        over binades, so that the order of a sum shows in its last bits."""
        words = self.raw(n)
        unit = (words >> np.uint64(11)).astype(np.float64) * 2.0 ** -53  # exact, [0, 1)
        exponent = (words & np.uint64(7)).astype(np.int32) - 6
        return (np.ldexp(2.0 * unit - 1.0, exponent) * scale).astype(np.float32)


def values(rng: Stream, n: int, dtype, *, specials: bool = True,
           scale: float = 1.0) -> np.ndarray:
    """n values of `dtype`: floats (see `Stream.floats`) with special values sprinkled
    in, or small integers."""
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        low = 0 if dt.kind == "u" else -20
        return ((rng.raw(n) % np.uint64(20 - low)).astype(np.int64) + low).astype(dt)
    out = rng.floats(n, scale).astype(dt)
    if specials and n:
        bits = SPECIAL_BITS[dt.name]
        count = min(n, max(len(bits), int(n * SPECIAL_SHARE)) if n >= 4 * len(bits) else 1)
        where = rng.distinct(count, n)
        view = out.view(f"u{dt.itemsize}")
        view[where] = np.array([bits[i % len(bits)] for i in range(where.size)],
                               dtype=view.dtype)
    return out


@dataclass(frozen=True)
class KernelCase:
    """One kernel on fixed inputs: `run(device)` -> {output name: NumPy array}."""

    name: str
    family: str
    run: Callable[[Device], dict]


# ------------------------------------------------------------------------ plumbing
def put(device: Device, host: np.ndarray):
    """A copy of `host` on `device`."""
    out = device.empty(host.shape, host.dtype)
    device.copy(out, host)
    return out


def fetch(device: Device, arrays: dict) -> dict:
    """{name: NumPy copy} of device arrays, once the device is done."""
    device.synchronize()
    return {k: np.array(device.to_host(v), copy=True) for k, v in arrays.items()}


def _dtype(name: str) -> np.dtype:
    if name != "bfloat16":
        return np.dtype(name)
    found = bfloat16()
    if found is None:
        raise RuntimeError("bfloat16 needs ml_dtypes, which is not installed")
    return found


# ---------------------------------------------------------------------------- sums
SUM_PAIRS = [("float32", "float32"), ("float16", "float32"), ("float16", "float16"),
             ("bfloat16", "float32"), ("bfloat16", "bfloat16"), ("float64", "float64"),
             ("int32", "int32"), ("int64", "int64"), ("int8", "int8"), ("uint8", "uint8")]


def _sum_case(t_name: str, u_name: str) -> KernelCase:
    name = f"sum {t_name}->{u_name}"

    def run(device):
        t, u = _dtype(t_name), _dtype(u_name)
        rng = Stream(name)
        same = t == u
        out_a = device.empty((N,), u)
        terms_a = [Term(put(device, values(rng, N, t)), same) for _ in range(3)]
        out_b = put(device, values(rng, 77, u))
        terms_b = [Term(out_b, True), Term(put(device, values(rng, 77, t)), same)]
        with device.activate():
            device.sum_into([(out_a, terms_a), (out_b, terms_b)])
        return fetch(device, {"three terms": out_a, "accumulate": out_b})

    return KernelCase(name, "sum", run)


def _tree_case(t_name: str, u_name: str) -> KernelCase:
    name = f"tree sum {t_name}->{u_name}"

    def run(device):
        t, u = _dtype(t_name), _dtype(u_name)
        rng = Stream(name)
        jobs, outs = [], {}
        for label, leaves, n in (("5 leaves", 5, N), ("13 leaves", 13, 77), ("1 leaf", 1, 5)):
            out = device.empty((n,), u)
            jobs.append((out, [put(device, values(rng, n, t)) for _ in range(leaves)]))
            outs[label] = out
        with device.activate():
            device.tree_sum_into(jobs)
        return fetch(device, outs)

    return KernelCase(name, "tree sum", run)


CAST_PAIRS = [("float32", "float16"), ("float32", "bfloat16"), ("float16", "float32"),
              ("bfloat16", "float32"), ("float64", "float32"), ("float32", "float64"),
              ("float64", "float16"), ("float64", "bfloat16"), ("float16", "float16")]


def _cast_case(src_name: str, dst_name: str) -> KernelCase:
    name = f"copy {src_name}->{dst_name}"

    def run(device):
        src_t, dst_t = _dtype(src_name), _dtype(dst_name)
        rng = Stream(name)
        pairs, outs = [], {}
        for label, n in (("large", N), ("small", 77)):
            dst = device.empty((n,), dst_t)
            pairs.append((dst, put(device, values(rng, n, src_t, scale=1e3))))
            outs[label] = dst
        with device.activate():
            device.copy_many(pairs)
        return fetch(device, outs)

    return KernelCase(name, "copy", run)


SEGMENT_DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "int64"]


def _segment_case(t_name: str) -> KernelCase:
    name = f"segment sum {t_name}"

    def run(device):
        t = _dtype(t_name)
        rng = Stream(name)
        rows, cols = 300, 33
        data = put(device, values(rng, rows * cols, t).reshape(rows, cols))
        cuts = np.sort(rng.distinct(40, rows, low=1))
        bounds = np.concatenate(([0], cuts, [rows])).astype(np.int64)
        with device.activate():
            out = device.segment_sum(data, put(device, bounds))
        return fetch(device, {"runs": out})

    return KernelCase(name, "segment sum", run)


# --------------------------------------------------------------------- compression
def _codec_case(codec: str) -> KernelCase:
    name = f"compression {codec}"

    def run(device):
        from ...device import codecs as ck
        rng = Stream(name)
        grad = put(device, values(rng, N, np.float32))
        residual = put(device, values(rng, N, np.float32, scale=0.3))
        base = values(rng, N, np.float32, specials=False)
        decoded = put(device, np.zeros(N, np.float32))
        added = put(device, base)
        outs = {}
        with device.activate():
            if codec in ("2bit", "1bit"):
                threshold = 0.5 if codec == "2bit" else 0.0
                if codec == "2bit":
                    payload = ck.quantize_2bit(grad, residual, threshold)
                    ck.dequantize_2bit(payload, N, threshold, decoded)
                    ck.dequantize_2bit(payload, N, threshold, added, accumulate=True)
                else:
                    payload = ck.quantize_1bit(grad, residual, threshold)
                    ck.dequantize_1bit(payload, N, decoded)
                    ck.dequantize_1bit(payload, N, added, accumulate=True)
                outs["residual"] = residual
            elif codec in ("sign", "ternary"):
                quantize = getattr(ck, f"quantize_{codec}")
                dequantize = getattr(ck, f"dequantize_{codec}")
                payload = quantize(grad, residual)
                dequantize(payload, N, decoded)
                dequantize(payload, N, added, accumulate=True)
                outs["residual"] = residual
            else:
                cast, uncast = ((ck.cast_fp16, ck.uncast_fp16) if codec.startswith("fp16")
                                else (ck.cast_bf16, ck.uncast_bf16))
                scale = 3.0 if codec.endswith("scaled") else 1.0
                payload = cast(grad, scale)
                uncast(payload, scale, decoded)
                uncast(payload, scale, added, accumulate=True)
            # the bf16 codec's payload is bfloat16 bit patterns kept as uint16: named so,
            # the goldens compare them as bfloat16 (NaN payloads and flushed values apart)
            outs["payload (bfloat16 bits)" if codec.startswith("bf16") else "payload"] = \
                payload
            outs.update(decoded=decoded, added=added)
        result = fetch(device, outs)
        if codec in ("sign", "ternary"):  # the scales as floats: NaN payloads apart
            from ...device.host_codecs import SIGN_BLOCK, TERNARY_BLOCK
            block = SIGN_BLOCK if codec == "sign" else TERNARY_BLOCK
            head = 4 * -(-N // block)
            payload = result.pop("payload")
            result["payload scales"] = payload[:head].view(np.float32)
            result["payload"] = payload[head:]
        return result

    return KernelCase(name, "compression", run)


CODECS = ["2bit", "1bit", "sign", "ternary", "fp16", "fp16 scaled", "bf16", "bf16 scaled"]


# ---------------------------------------------------------------------- optimizers
def optimizer_configs() -> dict:
    """name -> a function making the optimizer (rules and option sets the kernels differ by)."""
    from ... import optim
    return {
        "sgd": lambda: optim.SGD(learning_rate=0.1, wd=1e-3),
        "sgd momentum clip": lambda: optim.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3,
                                               clip_gradient=0.8, rescale_grad=0.5),
        "nag": lambda: optim.NAG(learning_rate=0.05, momentum=0.9, wd=1e-3,
                                 clip_gradient=1.0),
        "adam": lambda: optim.Adam(learning_rate=0.01, wd=1e-3, clip_gradient=0.5),
        "adamw": lambda: optim.AdamW(learning_rate=0.01, wd=1e-2),
        "adamw raw": lambda: optim.AdamW(learning_rate=0.01, wd=1e-2, correct_bias=False),
        "adagrad": lambda: optim.AdaGrad(learning_rate=0.1, wd=1e-3, clip_gradient=1.0),
        "rmsprop": lambda: optim.RMSProp(learning_rate=0.01, wd=1e-3),
        "rmsprop centered": lambda: optim.RMSProp(learning_rate=0.01, centered=True,
                                                  clip_weights=1.5, clip_gradient=1.0,
                                                  gamma2=0.8),
        "lamb": lambda: optim.LAMB(learning_rate=0.01, wd=1e-2),
        "lamb bounds": lambda: optim.LAMB(learning_rate=0.01, wd=1e-2, lower_bound=0.5,
                                          upper_bound=20.0, bias_correction=False,
                                          clip_gradient=0.3, rescale_grad=0.5),
    }


OPT_DTYPES = ["float32", "float16", "bfloat16", "float64"]


def _state_outputs(updater, keys, stored) -> dict:
    outs = {}
    for k, s in zip(keys, stored):
        outs[f"key {k} weight"] = s
        state = updater.states[k]
        for i, a in enumerate(state.arrays):
            outs[f"key {k} state {i}"] = a
        if state.master is not None:
            outs[f"key {k} master"] = state.master
    return outs


def _optimizer_case(config: str, w_name: str) -> KernelCase:
    name = f"optimizer {config} {w_name}"

    def run(device):
        from ...optim._updater import OptimizerUpdater
        w = _dtype(w_name)
        rng = Stream(name)
        specials = not config.startswith("lamb")  # a NaN would make a whole key's norm NaN
        updater = OptimizerUpdater(optimizer_configs()[config]())
        keys, sizes = [0, 1], {0: OPT_N, 1: 77}
        stored = [put(device, values(rng, sizes[k], w, specials=specials)) for k in keys]
        for step_keys in (keys, [0]):  # the second push leaves key 1 out
            grads = [put(device, values(rng, sizes[k], w, specials=specials))
                     for k in step_keys]
            with device.activate():
                updater.update(step_keys, grads, [stored[k] for k in step_keys],
                               [device] * len(step_keys))
        return fetch(device, _state_outputs(updater, keys, stored))

    return KernelCase(name, "optimizer", run)


ROW_CONFIGS = ["sgd momentum clip", "adam", "adagrad"]


def _rows_case(config: str) -> KernelCase:
    name = f"optimizer rows {config}"

    def run(device):
        from ...encoding.sparse import RowSparse
        from ...optim._updater import OptimizerUpdater
        rng = Stream(name)
        updater = OptimizerUpdater(optimizer_configs()[config]())
        shape = (64, 40)
        stored = put(device, values(rng, 64 * 40, np.float32).reshape(shape))
        for _ in range(2):
            ids = np.sort(rng.distinct(17, 64))
            data = values(rng, 17 * 40, np.float32).reshape(17, 40)
            grad = RowSparse(put(device, ids), put(device, data), shape)
            with device.activate():
                updater.update_rows([0], [grad], [stored], [device])
        return fetch(device, _state_outputs(updater, [0], [stored]))

    return KernelCase(name, "optimizer", run)


# ----------------------------------------------------------------------- the list
def all_cases() -> list:
    """Every case, in a fixed order (the goldens' order)."""
    cases = [_sum_case(t, u) for t, u in SUM_PAIRS]
    cases += [_tree_case(t, u) for t, u in SUM_PAIRS]
    cases += [_cast_case(s, d) for s, d in CAST_PAIRS]
    cases += [_segment_case(t) for t in SEGMENT_DTYPES]
    cases += [_codec_case(c) for c in CODECS]
    cases += [_optimizer_case(c, w) for c in optimizer_configs() for w in OPT_DTYPES]
    cases += [_rows_case(c) for c in ROW_CONFIGS]
    return cases


def needs_bfloat16(case: KernelCase) -> bool:
    """Whether the case holds NumPy bfloat16 arrays (ml_dtypes); the bf16 codec keeps its
    values as uint16 bit patterns and needs none."""
    return "bfloat16" in case.name
