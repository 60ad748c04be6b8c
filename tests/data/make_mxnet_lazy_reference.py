"""Write mxnet_lazy_reference.json: MXNet 1.9.1's optimizers on row_sparse gradients.

Run with the MXNet reference interpreter (mxnet==1.9.1, numpy==1.23.5), from any folder
but the mxnet package's own:

    python tests/data/make_mxnet_lazy_reference.py

Each case builds `mx.optimizer.get_updater(opt)` and feeds it, for a few steps, dense
float32 weights (what a gpukv key holds) and `mx.nd.sparse.row_sparse_array` gradients
whose row sets change from step to step (one step of one key has no rows at all). MXNet
then runs its sparse operators: `sgd_update` / `sgd_mom_update` / `adam_update` with
`lazy_update` (only the gradient's rows of the weight and of the states change) or
without it (the "standard" update of every row, absent rows with a zero gradient), and
the sparse `adagrad_update` (always lazy, no weight decay). NAG and RMSProp have no sparse
kernels: MXNet densifies the gradient. The JSON holds the initial weights, the row ids and
rows of every gradient, the weights after every step and the final states; floats are
written with repr, so float32 values survive.
"""
import os

import mxnet as mx
import numpy as np
from _mxnet_common import values, write_cases  # this script's folder

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mxnet_lazy_reference.json")
KEYS = [3, 7]
SHAPES = [(7, 3), (5, 2)]
STEPS = 4
ROWS = [  # per step, per key: the rows of the gradient (sorted, unique)
    [[0, 2, 5], [1, 4]],
    [[2, 3], []],
    [[0, 1, 2, 3, 4, 5, 6], [0, 4]],
    [[5], [1, 2, 3]],
]


def case(name, opt, **kwargs):
    return {"name": name, "optimizer": opt, "kwargs": kwargs}


CASES = [
    case("sgd_lazy", "sgd", learning_rate=0.1, wd=1e-2),
    case("sgd_lazy_clip_rescale", "sgd", learning_rate=0.1, wd=1e-2, rescale_grad=0.5,
         clip_gradient=0.3),
    case("sgd_std", "sgd", learning_rate=0.1, wd=1e-2, lazy_update=False),
    case("sgd_std_clip", "sgd", learning_rate=0.1, wd=1e-2, clip_gradient=0.4,
         lazy_update=False),
    case("sgd_mom_lazy", "sgd", learning_rate=0.1, momentum=0.9, wd=1e-3),
    case("sgd_mom_lazy_clip_rescale", "sgd", learning_rate=0.05, momentum=0.9, wd=1e-2,
         rescale_grad=0.5, clip_gradient=0.3),
    case("sgd_mom_std", "sgd", learning_rate=0.1, momentum=0.5, wd=1e-2, lazy_update=False),
    case("sgd_mom_std_clip", "sgd", learning_rate=0.1, momentum=0.5, wd=1e-2,
         clip_gradient=0.4, rescale_grad=2.0, lazy_update=False),
    case("adam_lazy", "adam", learning_rate=0.01, wd=1e-2),
    case("adam_lazy_clip_rescale", "adam", learning_rate=0.01, beta1=0.8, beta2=0.99,
         epsilon=1e-6, wd=1e-2, rescale_grad=0.5, clip_gradient=0.5),
    case("adam_std", "adam", learning_rate=0.01, wd=1e-2, lazy_update=False),
    case("adam_std_clip", "adam", learning_rate=0.01, wd=1e-2, clip_gradient=0.5,
         rescale_grad=0.5, lazy_update=False),
    case("adagrad_sparse", "adagrad", learning_rate=0.1),
    case("adagrad_sparse_clip_rescale", "adagrad", learning_rate=0.1, clip_gradient=0.5,
         rescale_grad=0.5, eps=1e-6),
    case("nag_dense_fallback", "nag", learning_rate=0.1, momentum=0.9, wd=1e-3),
    case("rmsprop_dense_fallback", "rmsprop", learning_rate=0.01, wd=1e-2),
]

STATE_NAMES = {"sgd": ("mom",), "nag": ("mom",), "adam": ("mean", "var"),
               "adagrad": ("history",), "rmsprop": ("n",)}


def run(c, seed):
    rng = np.random.RandomState(seed)
    w0 = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    grads = [[rng.standard_normal((len(rows),) + s[1:]).astype(np.float32)
              for rows, s in zip(ROWS[step], SHAPES)] for step in range(STEPS)]
    opt = mx.optimizer.create(c["optimizer"], **c["kwargs"])
    updater = mx.optimizer.get_updater(opt)
    weights = [mx.nd.array(w, dtype=np.float32) for w in w0]
    after = []
    for step in range(STEPS):
        for i, (key, shape) in enumerate(zip(KEYS, SHAPES)):
            rows = ROWS[step][i]
            grad = mx.nd.sparse.row_sparse_array(
                (grads[step][i], np.array(rows, np.int64)), shape=shape, dtype=np.float32)
            updater(key, grad, weights[i])
        after.append([values(w.asnumpy()) for w in weights])
    states = {}
    for key in KEYS:
        state = updater.states[key]
        if state is None:
            state = ()
        elif isinstance(state, mx.nd.NDArray):
            state = (state,)
        names = STATE_NAMES[c["optimizer"]]
        states[str(key)] = {n: values(a.tostype("default").asnumpy())
                            for n, a in zip(names, state)}
    return {"name": c["name"], "optimizer": c["optimizer"], "kwargs": c["kwargs"],
            "keys": KEYS, "shapes": [list(s) for s in SHAPES],
            "init": [values(w) for w in w0],
            "rows": ROWS, "grads": [[values(g) for g in gs] for gs in grads],
            "after": after, "states": states}


def main():
    write_cases(OUT, [run(c, 2000 + i) for i, c in enumerate(CASES)], STEPS)


if __name__ == "__main__":
    main()
