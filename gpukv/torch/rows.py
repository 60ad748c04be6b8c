"""Sparse gradients pushed as rows: the weights of nn.Embedding and nn.EmbeddingBag with
sparse=True. A step pushes the rows backward touched (`gpukv.RowSparse`), so that the
store's optimizer updates those rows only (its `lazy_update`), as gluon's Trainer does
with Embedding(sparse_grad=True). With update_on_kvstore=False, and to a dist or a
deterministic store, they go dense, every row (the Trainer warns).

The gradient stays in its bucket view, dense, as any other (backward adds into it, or
the step copies in the sparse `.grad` backward made after `.grad` was set to None): the
Trainer's checks see one tensor. A hook on each replica's parameter notes the rows of
every sparse gradient backward makes for it; the step takes those rows of the view, and
the notes start afresh.

`Trainer.zero_grad()` zeroes those rows of the view alone, not the whole table, while
the view's counter of in-place writes shows that backward alone wrote it since: a
write of the program's own (clipping, unscaling, an add) has it zeroed whole.
"""
from __future__ import annotations

import warnings
import weakref

import numpy as np
import torch

from ..encoding.sparse import RowSparse
from .buckets import Bucket

#: the modules whose weight gets sparse gradients when made with sparse=True
SPARSE_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def sparse_gradient_names(module) -> list[str]:
    """The names of `module`'s parameters whose gradients come sparse."""
    return [f"{prefix}.weight" if prefix else "weight"
            for prefix, m in module.named_modules()
            if isinstance(m, SPARSE_MODULES) and m.sparse]


class SparseGradientsMadeDense(UserWarning):
    """Parameters with sparse gradients that a Trainer sums and updates densely."""


def warn_made_dense(names: list, why: str) -> None:
    """Warn that the parameters `names`, whose gradients come sparse, are pushed dense,
    every row at every step (`why`: where that is so)."""
    warnings.warn(
        f"parameter(s) {', '.join(repr(n) for n in names)}: sparse gradients (sparse=True) "
        f"are pushed dense {why}: every row is summed and updated at every step, as with "
        f"sparse=False (lazy_update has no effect); the rows a batch touched alone are "
        f"pushed with the optimizer on a one-process store that is not deterministic",
        SparseGradientsMadeDense, stacklevel=4)


class TouchedRows:
    """The rows backward touched in each replica's parameter of each bucket of `buckets`
    (each a bucket of one parameter with sparse gradients) since the last `clear`.

    A row noted whose gradient is zero at the step (its backward's gradient dropped by
    `model.zero_grad()`, or never accumulated: `torch.autograd.grad`) is not pushed. A
    replica's gradient that is dense (backward made one, or the program assigned one)
    sends the bucket dense for that step.
    """

    def __init__(self, buckets: list[Bucket]) -> None:
        #: id(bucket) -> per replica: the row ids of each sparse gradient backward made,
        #: or None once a gradient was dense (then the bucket is pushed dense)
        self._noted: dict = {id(b): [[] for _ in b.params] for b in buckets}
        #: id(bucket) -> the rows the step pushed (`kept`)
        self._pushed: dict = {}
        self._versions = {id(b): _versions(b) for b in buckets}
        #: id(bucket) -> per replica: where its gradient view may be nonzero (`zero`)
        self._written: dict = {id(b): [_Written() for _ in b.params] for b in buckets}
        self._buckets = buckets
        # The newest Trainer's notes only (`take_over`): an older one kept alive notes
        # nothing.
        self._token = token = object()
        handles = []
        for bucket in buckets:
            notes = self._noted[id(bucket)]
            for r, (params, views, written) in enumerate(
                    zip(bucket.params, bucket.views, self._written[id(bucket)])):
                p = params[0]
                handles.append(p.register_hook(_note(notes, r, p, views[0], written, token)))
                handles.append(p.register_post_accumulate_grad_hook(
                    _settled(p, views[0], written, token)))
        # The hooks hold the notes, not this object: a Trainer dropped takes them with it.
        weakref.finalize(self, _unhook, handles)

    def take_over(self, params) -> None:
        """From now on, backward's gradients of `params` (every parameter of the Trainer
        made) are noted here, for those of `buckets`, and by no older Trainer's hooks."""
        mine = {id(p[0]) for b in self._buckets for p in b.params}
        for p in params:
            setattr(p, NOTER, self._token if id(p) in mine else None)

    def pushes_rows(self, bucket: Bucket) -> bool:
        """Whether `bucket`'s gradients go as rows (each replica's were sparse, or
        none)."""
        notes = self._noted.get(id(bucket))
        return notes is not None and all(n is not None for n in notes)

    def check_assigned(self) -> None:
        """Before the gradients are gathered: a replica whose `.grad` the program set to
        a dense tensor of its own sends its bucket dense."""
        for bucket in self._buckets:
            notes = self._noted[id(bucket)]
            for r, (params, views) in enumerate(zip(bucket.params, bucket.views)):
                grad = params[0].grad
                if grad is not None and grad is not views[0] and not grad.is_sparse:
                    notes[r] = None

    def values(self, bucket: Bucket) -> list[RowSparse]:
        """Each replica's gradient at the rows it touched among those to push (`kept`:
        their sum is the summed gradient at every row kept; `pushes_rows` must hold)."""
        shape = tuple(bucket.params[0][0].shape)
        kept = self.kept(bucket)
        found = []
        for grad, noted in zip(bucket.grads, self._noted[id(bucket)]):
            mine = _unique(noted, grad.device)
            mine = mine[torch.isin(mine, kept.to(grad.device))]
            found.append(RowSparse(mine, grad.view(shape).index_select(0, mine), shape))
        return found

    def value_of_sum(self, bucket: Bucket, summed: torch.Tensor) -> RowSparse:
        """`summed` (the replicas' gradients summed) at the rows to push (`kept`)."""
        shape = tuple(bucket.params[0][0].shape)
        rows = self.kept(bucket).to(summed.device)
        return RowSparse(rows, summed.view(shape).index_select(0, rows), shape)

    def kept(self, bucket: Bucket) -> torch.Tensor:
        """The rows a step pushes (kept for `pull`): those any replica touched, less the
        rows where every replica's gradient is zero (a backward whose gradients the
        program dropped, or that never reached `.grad`); on replica 0's device."""
        shape = tuple(bucket.params[0][0].shape)
        device = bucket.grads[0].device
        rows = _unique([i for noted in self._noted[id(bucket)] for i in noted], device)
        nonzero = torch.zeros(len(rows), dtype=torch.bool, device=device)
        for grad in bucket.grads:
            at = grad.view(shape).index_select(0, rows.to(grad.device))
            nonzero |= _nonzero_rows(at).to(device)
        self._pushed[id(bucket)] = rows = rows[nonzero]
        return rows

    def written_since_last_step(self, bucket: Bucket) -> bool:
        """Whether the program wrote a replica's weights in place since the last step
        asked (a `load_state_dict`, an embedding's `max_norm` in a forward): then the
        whole table comes back from the store, not the rows pushed alone."""
        now = _versions(bucket)
        moved = now != self._versions[id(bucket)]
        self._versions[id(bucket)] = now
        return moved

    def pull(self, store, bucket: Bucket) -> None:
        """Every replica's weights of `bucket` take the rows of the store's value that
        the step pushed (`kept`): after a lazy update, the only rows that changed."""
        shape = tuple(bucket.params[0][0].shape)
        pushed = self._pushed[id(bucket)]
        rows = [pushed.to(w.device) for w in bucket.weights]
        outs = [RowSparse(torch.zeros(0, dtype=torch.int64, device=w.device),
                          torch.zeros((0,) + shape[1:], dtype=w.dtype, device=w.device),
                          shape) for w in bucket.weights]
        store.row_sparse_pull(bucket.key, out=outs, row_ids=rows)
        with torch.no_grad():
            for w, r, out in zip(bucket.weights, rows, outs):
                _put_rows(w.view(shape), r, out.data)

    def tracks(self, bucket: Bucket) -> bool:
        """Whether `bucket` is one of a sparse table's (its `zero` may be cheaper)."""
        return id(bucket) in self._written

    def zero(self, bucket: Bucket) -> None:
        """Zero every replica's gradient of `bucket` (`tracks` must hold): the rows
        backward wrote since the last zero alone, where backward alone wrote it (its
        counter of in-place writes says so); else the whole view."""
        shape = tuple(bucket.params[0][0].shape)
        for grad, written in zip(bucket.grads, self._written[id(bucket)]):
            if written.rows is None or grad._version != written.version:  # noqa: SLF001
                grad.zero_()
            elif written.rows:
                rows = _unique(written.rows, grad.device)
                grad.view(shape).index_fill_(0, rows, 0)
            written.rows, written.version = [], grad._version  # noqa: SLF001

    def clear(self) -> None:
        """The gradients were used (or dropped): note afresh."""
        for notes in self._noted.values():
            notes[:] = [[] for _ in notes]
        self._pushed.clear()


#: the attribute of a parameter holding the token of the TouchedRows whose hooks note
#: its rows (the newest Trainer's)
NOTER = "_gpukv_rows_noter"


class _Written:
    """Where one replica's gradient view of a sparse table may be nonzero since the
    Trainer last zeroed it: `rows`, the row ids of backward's sparse gradients, or None
    for anywhere; `version`, the view's counter of in-place writes after backward's last
    write (the hooks keep both)."""

    __slots__ = ("rows", "version")

    def __init__(self) -> None:
        self.rows: list | None = None  # (the view's first contents are the program's)
        self.version = -1


def _nonzero_rows(at: torch.Tensor) -> torch.Tensor:
    """Whether each row of `at` has an element other than 0 (a NaN counts)."""
    flat = at.flatten(1)
    if flat.shape[1] == 0:
        return torch.zeros(flat.shape[0], dtype=torch.bool, device=at.device)
    # (a NaN's amax is NaN, which is not 0: ten times faster than ne(0).any(dim=1))
    return flat.abs().amax(dim=1).ne(0)


def _versions(bucket: Bucket) -> list[int]:
    # (`_version` is how PyTorch shows a tensor's counter of in-place writes)
    return [params[0]._version for params in bucket.params]  # noqa: SLF001


def _unique(ids: list, device) -> torch.Tensor:
    """The row ids of `ids` (tensors), sorted, without repeats, on `device`."""
    if not ids:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.cat([i.to(device) for i in ids]).unique()


def _put_rows(w: torch.Tensor, rows: torch.Tensor, data) -> None:
    """w[rows] = data (NumPy or CuPy rows of w's dtype, on w's device); on the host by
    NumPy's indexing, which takes a third of the time of torch's index_copy_ there."""
    if w.device.type != "cpu":
        w.index_copy_(0, rows, _as_torch(data, w))
        return
    if w.dtype == torch.bfloat16:  # (NumPy holds it through ml_dtypes, torch not)
        w, data = w.view(torch.int16), data.view(np.int16)
    w.numpy()[rows.numpy()] = data


def _as_torch(array, like: torch.Tensor) -> torch.Tensor:
    """`array` (NumPy or CuPy, of `like`'s dtype and device) as a torch tensor, sharing
    its memory: a GPU array through DLPack, which orders torch's stream after CuPy's
    work; bfloat16 through its bits (NumPy has it through ml_dtypes only, CuPy not)."""
    if isinstance(array, np.ndarray):
        if array.dtype.name == "bfloat16":
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)
    tensor = torch.from_dlpack(array)
    return tensor if tensor.dtype == like.dtype else tensor.view(like.dtype)


def _note(notes: list, r: int, param, view, written: _Written, token):
    """Before backward adds a gradient into `param.grad`: its rows into `notes[r]` (the
    rows to push) and `written` (the rows to zero), or, for a dense gradient or after
    a write of the program's own into `view`, None (all of them)."""
    def hook(grad: torch.Tensor) -> None:
        if getattr(param, NOTER, None) is not token:
            return
        if not grad.is_sparse:
            notes[r] = written.rows = None
            return
        if written.rows is not None and param.grad is view and \
                view._version != written.version:  # noqa: SLF001
            written.rows = None
        rows = grad.coalesce().indices()[0]
        for noted in (notes[r], written.rows):
            if noted is not None:
                noted.append(rows)
    return hook


def _settled(param, view, written: _Written, token):
    """After backward added a gradient into `param.grad`: `view`'s counter of writes,
    where that gradient is `view`."""
    def hook(_param) -> None:
        if getattr(param, NOTER, None) is token and param.grad is view:
            written.version = view._version  # noqa: SLF001
    return hook


def _unhook(handles: list) -> None:
    for handle in handles:
        handle.remove()
