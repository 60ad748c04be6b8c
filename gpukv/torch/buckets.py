"""Gradient buckets: the trainable parameters of every replica, grouped into store keys
whose weights and gradients are views of one flat buffer per replica."""
from __future__ import annotations

import torch

from .._dtypes import NARROW_FLOATS
from .._errors import ArgumentError, DTypeError, ShapeError

#: bucket capacity in bytes (PyTorch DDP's default)
BUCKET_BYTES = 25 << 20
#: capacity of the first bucket backward fills (DDP's too)
FIRST_BUCKET_BYTES = 1 << 20


class Bucket:
    """Consecutive trainable parameters of one dtype that share one store key.

    `weights[r]` / `grads[r]` are replica r's flat buffers (or, for a bucket of one
    parameter, the parameter's own tensors); `params[r][i]` is replica r's i-th parameter.
    """

    def __init__(self, names: list, params: list) -> None:
        self.names = names
        self.params = params  # [replica][i]
        self.key = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        self.weights: list = []
        self.grads: list = []
        self.views: list = []  # [replica][i]: the grad view param i must hold
        #: with overlap and update_on_kvstore: the summed gradient, on replica 0's device
        self.summed: torch.Tensor | None = None

    @property
    def fused(self) -> bool:
        return len(self.names) > 1

    @property
    def dtype_name(self) -> str:
        """Its parameters' dtype, as NumPy names it ('float32', 'float16', ...)."""
        return str(self.params[0][0].dtype).removeprefix("torch.")

    @property
    def narrow(self) -> bool:
        """Whether its parameters are float16 or bfloat16: the stores sum and update
        them in float32 (a master copy of the weights)."""
        return str(self.params[0][0].dtype).removeprefix("torch.") in NARROW_FLOATS


def trainable(modules) -> tuple[list, list]:
    """Names and per-replica tensors of the trainable parameters, checked to agree: every
    replica has the parameters of replica 0, no others, each trainable in all or none."""
    first = [(n, p) for n, p in modules[0].named_parameters() if p.requires_grad]
    names = [n for n, _ in first]
    params = [[p for _, p in first]]
    zero = dict(modules[0].named_parameters())
    for r, module in enumerate(modules[1:], start=1):
        mine = dict(module.named_parameters())
        lacking = [name for name in zero if name not in mine]
        if lacking:
            raise ArgumentError(f"parameter {lacking[0]!r}: {_state(zero[lacking[0]])} in "
                                f"replica 0 but missing in replica {r}")
        for name, p in mine.items():
            p0 = zero.get(name)
            if p0 is None or p.requires_grad != p0.requires_grad:
                raise ArgumentError(f"parameter {name!r}: {_state(p)} in replica {r} but "
                                    f"{'missing' if p0 is None else _state(p0)} in "
                                    f"replica 0")
        row = []
        for name, p0 in first:
            p = mine.get(name)
            if p is None:
                raise ArgumentError(f"parameter {name!r}: trainable in replica 0 but "
                                    f"missing in replica {r}")
            if p.shape != p0.shape or p.dtype != p0.dtype:
                error = ShapeError if p.shape != p0.shape else DTypeError
                raise error(f"parameter {name!r}: replica 0 holds {tuple(p0.shape)} "
                            f"{p0.dtype}, replica {r} {tuple(p.shape)} {p.dtype}")
            row.append(p)
        for other, theirs in enumerate(params):
            shared = [name for name, p, q in zip(names, row, theirs) if p is q] or (
                {id(p) for p in row} & {id(q) for q in theirs})
            if shared:
                named = f" ({shared[0]!r})" if isinstance(shared, list) else ""
                raise ArgumentError(f"replica {r} shares parameters with replica {other}"
                                    f"{named}; give each device its own copy "
                                    f"(copy.deepcopy)")
        params.append(row)
    return names, params


def frozen(modules) -> list:
    """(name, replica, tensor) of every parameter with requires_grad=False."""
    return [(name, r, p) for r, module in enumerate(modules)
            for name, p in module.named_parameters() if not p.requires_grad]


def _state(p) -> str:
    return "trainable" if p.requires_grad else "frozen"


def make_buckets(names, params, capacity: int, alone=frozenset(),
                 first_capacity: int = FIRST_BUCKET_BYTES) -> list:
    """Consecutive parameters of one dtype and the same devices, up to `capacity` bytes;
    the parameters named in `alone` each in a bucket of its own. Returned in parameter
    order.

    As DDP's, buckets are filled in the order backward produces gradients (the reverse
    of the parameters'), and the first one of each kind holds at most `first_capacity`
    bytes, so that a reduction started from backward can start early in it. (DDP closes a
    bucket once it holds its capacity or more, the parameter that passes it included; a
    parameter that would pass it starts the next bucket here, so no bucket but a lone
    parameter's holds more than its capacity.)
    """
    buckets: list[tuple[int, Bucket]] = []  # (first parameter index, bucket)
    open_: dict = {}  # signature -> (indices, bytes)
    closed: set = set()  # signatures whose first bucket is closed

    def close(sig):
        idx, _ = open_.pop(sig)
        idx.reverse()
        closed.add(sig)
        buckets.append((idx[0], Bucket([names[i] for i in idx],
                                       [[row[i] for i in idx] for row in params])))
    for i in reversed(range(len(params[0]))):
        p = params[0][i]
        if names[i] in alone:
            buckets.append((i, Bucket([names[i]], [[row[i]] for row in params])))
            continue
        sig = (p.dtype, tuple(str(row[i].device) for row in params))
        size = p.numel() * p.element_size()
        limit = capacity if sig in closed else min(capacity, first_capacity)
        if sig in open_ and open_[sig][1] + size > limit:
            close(sig)
        idx, total = open_.get(sig, ([], 0))
        open_[sig] = (idx + [i], total + size)
    for sig in list(open_):
        close(sig)
    return [bucket for _, bucket in sorted(buckets, key=lambda pair: pair[0])]


def flatten(bucket: Bucket, replicas: int) -> None:
    """Make every replica's weights and gradients of `bucket` views of one buffer each.

    A bucket of one parameter uses the parameter's own (contiguous) tensors.
    """
    with torch.no_grad():
        for r in range(replicas):
            params = bucket.params[r]
            if not bucket.fused and params[0].is_contiguous():
                p = params[0]
                if p.grad is None or not p.grad.is_contiguous() or p.grad.shape != p.shape:
                    grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    if p.grad is not None:
                        grad.copy_(p.grad)
                    p.grad = grad
                bucket.weights.append(p.data)
                bucket.grads.append(p.grad)
                bucket.views.append([p.grad])
                continue
            total = sum(p.numel() for p in params)
            weight = torch.empty(total, dtype=params[0].dtype, device=params[0].device)
            grad = torch.zeros_like(weight)
            views, offset = [], 0
            for p in params:
                n = p.numel()
                w_view = weight[offset:offset + n].view(p.shape)
                g_view = grad[offset:offset + n].view(p.shape)
                w_view.copy_(p.data)
                p.data = w_view
                if p.grad is not None:
                    g_view.copy_(p.grad)
                p.grad = g_view
                views.append(g_view)
                offset += n
            bucket.weights.append(weight)
            bucket.grads.append(grad)
            bucket.views.append(views)
