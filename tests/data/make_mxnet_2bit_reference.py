"""Record MXNet 1.9.1's gradient-compression and row-sparse behaviour as JSON.

Run under an interpreter with mxnet==1.9.1 (CPU) and numpy==1.23.5:

    mxenv/bin/python tests/data/make_mxnet_2bit_reference.py

It writes mxnet_2bit_reference.json and mxnet_sparse_reference.json next to itself.
The packed 2-bit bytes come from MXNet's own GradientCompression::Quantize (called
through libmxnet's exported C++ symbols), so they are the bytes MXNet puts on the wire.
"""
import ctypes
import json
import os

import mxnet as mx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
_LIB = ctypes.CDLL(mx.libinfo.find_lib_path()[0])
_PREFIX = "_ZN5mxnet7kvstore19GradientCompression"
_ctor = getattr(_LIB, _PREFIX + "C1Ev")
_set_2bit = getattr(_LIB, _PREFIX + "20SetTwoBitCompressionEf")
_set_2bit.argtypes = [ctypes.c_void_p, ctypes.c_float]
_quantize = getattr(_LIB, _PREFIX + "8QuantizeERKNS_7NDArrayEPS2_S5_i")
_quantize.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int]
_dequantize = getattr(_LIB, _PREFIX + "10DequantizeERKNS_7NDArrayEPS2_i")
_dequantize.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int]
_csize = getattr(_LIB, _PREFIX + "17GetCompressedSizeEl")
_csize.argtypes = [ctypes.c_void_p, ctypes.c_long]
_csize.restype = ctypes.c_long


class TwoBit:
    """MXNet's GradientCompression object, set to 2bit with `threshold`."""

    def __init__(self, threshold):
        self._buf = ctypes.create_string_buffer(64)  # vtable, type_, threshold_
        _ctor(self._buf)
        _set_2bit(self._buf, threshold)

    def quantize(self, grad, residual):
        words = _csize(self._buf, grad.size)
        to = mx.nd.zeros((words,))
        _quantize(self._buf, grad.handle.value, to.handle.value, residual.handle.value, 0)
        mx.nd.waitall()
        return to.asnumpy().view(np.uint8).tobytes()

    def dequantize(self, payload_bytes, n):
        words = np.frombuffer(payload_bytes, np.float32)
        frm = mx.nd.array(words, dtype=np.float32)
        to = mx.nd.zeros((n,))
        _dequantize(self._buf, frm.handle.value, to.handle.value, 0)
        mx.nd.waitall()
        return to.asnumpy()


def f32list(a):
    return np.asarray(a, np.float32).ravel().tolist()


def quantize_cases():
    cases = []
    rng = np.random.RandomState(7)
    specs = [(1, 0.5, 1.0), (5, 0.5, 1.0), (16, 0.5, 1.0), (17, 0.25, 0.5), (33, 1.0, 2.0),
             (100, 0.5, 1.0), (257, 0.1, 0.3), (1000, 2.0, 3.0)]
    for n, threshold, scale in specs:
        gc = TwoBit(threshold)
        residual_in = (rng.randn(n) * threshold).astype(np.float32)
        residual = mx.nd.array(residual_in)
        steps = []
        for _ in range(3):  # the residual carries over between calls
            grad = (rng.randn(n) * scale).astype(np.float32)
            grad[rng.rand(n) < 0.1] = threshold  # exact-threshold ties
            payload = gc.quantize(mx.nd.array(grad), residual)
            steps.append({"grad": f32list(grad), "packed_hex": payload.hex(),
                          "residual_after": f32list(residual.asnumpy()),
                          "decoded": f32list(gc.dequantize(payload, n))})
        cases.append({"n": n, "threshold": threshold, "residual_in": f32list(residual_in),
                      "steps": steps})
    return cases


def decode_every_byte():
    gc = TwoBit(0.5)
    payload = bytes(range(256))  # 64 words, every byte value once (0b01 codes included)
    return {"threshold": 0.5, "packed_hex": payload.hex(),
            "decoded": f32list(gc.dequantize(payload, 1024))}


def kvstore_sequence(num_dev=4, threshold=0.5, rate=2.0):
    """The nightly compression sequence: 4 devices, updater w += rate * g."""
    shape = (3, 5)
    kv = mx.kv.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": threshold})

    def update(key, grad, weight):
        weight += grad * rate

    kv._set_updater(update)
    kv.init(0, mx.nd.zeros(shape))
    kv.init(1, mx.nd.ones(shape))  # init is never compressed
    out = mx.nd.zeros(shape)
    kv.pull(1, out=out)
    init_value = float(out.asnumpy()[0, 0])
    steps = []
    for g in [0.0, 0.4, 0.2, 0.2, 0.2] + [-0.5] * 10 + [0.3, 0.3, -1.3]:
        kv.push(0, [mx.nd.ones(shape, ctx=mx.cpu(d)) * g for d in range(num_dev)])
        kv.pull(0, out=out)
        steps.append({"push_each": g, "pulled": f32list(out.asnumpy())})
    return {"devices": num_dev, "threshold": threshold, "rate": rate, "shape": list(shape),
            "init_ones_pulled": init_value, "steps": steps}


def kvstore_random(num_dev=3, threshold=0.3, seed=11):
    """Random per-device pushes, no updater (assign): the pulled sums of dequantized values."""
    rng = np.random.RandomState(seed)
    shape = (4, 9)
    kv = mx.kv.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": threshold})
    kv.init("k", mx.nd.zeros(shape))
    out = mx.nd.zeros(shape)
    steps = []
    for _ in range(4):
        grads = [(rng.randn(*shape) * 0.4).astype(np.float32) for _ in range(num_dev)]
        kv.push("k", [mx.nd.array(g, ctx=mx.cpu(d)) for d, g in enumerate(grads)])
        kv.pull("k", out=out)
        steps.append({"grads": [f32list(g) for g in grads], "pulled": f32list(out.asnumpy())})
    single = mx.kv.create("device")
    single.set_gradient_compression({"type": "2bit", "threshold": threshold})
    single.init(0, mx.nd.zeros((2, 2)))
    single.push(0, mx.nd.array([[0.1, 0.35], [-0.31, -0.2]]))
    o = mx.nd.zeros((2, 2))
    single.pull(0, out=o)
    return {"devices": num_dev, "threshold": threshold, "shape": list(shape), "steps": steps,
            "single_source": {"grad": [[0.1, 0.35], [-0.31, -0.2]],
                              "pulled": f32list(o.asnumpy())}}


def refusals():
    result = {}
    for name in ["local", "device"]:
        kv = mx.kv.create(name)
        try:
            kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
            result[name] = "accepted"
        except Exception as exc:  # MXNet raises a bare Exception / MXNetError
            result[name] = str(exc).strip().splitlines()[-1]
    for label, params in [("threshold_zero", {"type": "2bit", "threshold": 0}),
                          ("threshold_negative", {"type": "2bit", "threshold": -1}),
                          ("type_unknown", {"type": "3bit"})]:
        kv = mx.kv.create("device")
        try:
            kv.set_gradient_compression(params)
            result[label] = "accepted"
        except Exception as exc:
            result[label] = str(exc).strip().splitlines()[-1]
    return result


def sparse_reference():
    shape = (6, 2)

    def rsp(idx, data):
        return mx.nd.sparse.row_sparse_array(
            (np.array(data, np.float32), np.array(idx, np.int64)), shape=shape)

    kv = mx.kv.create("device")
    kv.init("w", rsp([1, 3], [[1, 1], [3, 3]]))
    rec = {"shape": list(shape), "init": {"indices": [1, 3], "data": [[1, 1], [3, 3]]}}
    out = mx.nd.sparse.zeros("row_sparse", shape)
    kv.row_sparse_pull("w", out=out, row_ids=mx.nd.array([3, 0, 3, 5]))
    rec["pull_after_init"] = {"row_ids": [3, 0, 3, 5], "indices": out.indices.asnumpy().tolist(),
                              "data": out.data.asnumpy().tolist()}
    a = ([0, 2], [[1, 1], [2, 2]])
    b = ([2, 4], [[10, 10], [40, 40]])
    kv.push("w", [rsp(*a), rsp(*b)])
    rec["push"] = [{"indices": a[0], "data": a[1]}, {"indices": b[0], "data": b[1]}]
    kv.row_sparse_pull("w", out=out, row_ids=mx.nd.array([[5, 4, 3], [2, 1, 0]]))
    rec["pull_after_push"] = {"row_ids": [[5, 4, 3], [2, 1, 0]],
                              "indices": out.indices.asnumpy().tolist(),
                              "data": out.data.asnumpy().tolist()}
    dense = mx.nd.zeros(shape)
    kv.pull("w", out=dense)
    rec["dense_pull_after_push"] = dense.asnumpy().tolist()
    skipped = rsp([5], [[9, 9]])
    kv.pull("w", out=skipped)  # ignore_sparse=True: the row-sparse out is left alone
    rec["ignore_sparse_true_out"] = {"indices": skipped.indices.asnumpy().tolist(),
                                     "data": skipped.data.asnumpy().tolist()}
    seen = []

    def update(key, grad, weight):
        seen.append({"stype": grad.stype, "indices": grad.indices.asnumpy().tolist(),
                     "data": grad.data.asnumpy().tolist()})
        weight += grad

    kv._set_updater(update)
    kv.push("w", [rsp(*a), rsp(*b)])
    kv.row_sparse_pull("w", out=out, row_ids=mx.nd.array([0, 1, 2, 3, 4, 5]))
    rec["updater_saw"] = seen
    rec["pull_after_updater_push"] = {"indices": out.indices.asnumpy().tolist(),
                                      "data": out.data.asnumpy().tolist()}
    outs = [mx.nd.sparse.zeros("row_sparse", shape) for _ in range(2)]
    kv.row_sparse_pull("w", out=outs, row_ids=mx.nd.array([3, 1, 3]))
    rec["shared_row_ids"] = {"row_ids": [3, 1, 3],
                             "indices": [o.indices.asnumpy().tolist() for o in outs]}
    return rec


def main():
    ref = {"mxnet_version": mx.__version__, "quantize": quantize_cases(),
           "decode_every_byte": decode_every_byte(), "kvstore_sequence": kvstore_sequence(),
           "kvstore_random": kvstore_random(), "refusals": refusals()}
    with open(os.path.join(HERE, "mxnet_2bit_reference.json"), "w") as f:
        json.dump(ref, f, separators=(",", ":"))
        f.write("\n")
    with open(os.path.join(HERE, "mxnet_sparse_reference.json"), "w") as f:
        json.dump({"mxnet_version": mx.__version__, **sparse_reference()}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
