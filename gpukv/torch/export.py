"""A Trainer's snapshot as a file other tools open (`python -m gpukv export SNAPSHOT
OUT.safetensors`, whose command line is `gpukv.tools.export`'s): its model's parameters
under their own names (`model.state_dict()`'s), in safetensors; `torch.load`-free:
`safetensors.torch.load_file(OUT)` gives a dict that `model.load_state_dict(...)` takes:
the trained parameters, the parameters frozen when the Trainer was made and the buffers
(BatchNorm's running statistics), the last two as worker 0's replica 0 had them. (A
snapshot taken before snapshots kept frozen parameters has none: `strict=False` then.)

The snapshot records which parameters each store key holds (a bucket fuses several, in
order, flat); the export cuts every key's value back into them. A parameter the model
holds under several names (an embedding tied to the output layer) is written under each
of them, as a copy of its own: safetensors refuses tensors that share memory, and
`load_state_dict` copies each into the one parameter again. The names beside the first
are also in the file's metadata (`{name: the name it is tied to}`, as
`safetensors.torch.save_model` records the names it leaves out). A snapshot taken before
snapshots recorded tied names has the first name only: `strict=False` then.
SNAPSHOT is a snapshot's folder (`step-<step>-<tag>-r<run>`) or a Trainer's
`checkpoint_dir`, whose newest complete snapshot is taken.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np

from .._errors import CheckpointError
from ..checkpoints import snapshots
from ..checkpoints.checkpoint import _fsync_dir, file_mode
from ..checkpoints.user_state import torch_tensor
from .checkpoints import parameter_layout


def snapshot_tensors(snapshot) -> tuple[dict, dict, snapshots.Snapshot | str]:
    """({parameter name: torch tensor}, {tied name: the name it is tied to}, the snapshot
    read) of a Trainer's snapshot (a folder, a Snapshot, or a checkpoint_dir: its
    newest); a tied parameter is under each of its names, the same tensor."""
    path = os.fspath(snapshot)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: does not exist (name a snapshot's folder or a "
                              f"Trainer's checkpoint_dir)")
    if not snapshots.is_snapshot(path):
        found = snapshots.latest_snapshot(path)
        if found is None:
            raise CheckpointError(f"{path}: no complete snapshot here (a snapshot's folder "
                                  f"is named step-<step>-<tag>-r<run>)")
        path = found.path
    saved = snapshots.read_worker(path, 0)[1]
    tensors = _stored_parameters(saved, path)
    for kept in ("frozen", "buffers"):
        for name, tensor in (saved["trainer"].get(kept) or {}).items():
            tensors[name] = tensor.contiguous()
    tied = _tied_names(saved, path)
    for name, first in tied.items():
        if first not in tensors:
            raise CheckpointError(f"{path}: the tied parameter {name!r} names "
                                  f"{first!r}, which the snapshot does not hold")
        tensors[name] = tensors[first]
    return tensors, tied, path


def _stored_parameters(saved: dict, path) -> dict:
    """{name: torch tensor} of the trainable parameters, cut out of the store's keys
    (`saved`: worker 0's user_state)."""
    layout = parameter_layout(saved, path)
    contents = snapshots.read_store(path)
    values = dict(zip(contents.keys, contents.values))
    tensors: dict = {}
    for key, params in layout.items():
        if key not in values:
            raise CheckpointError(f"{path}: key {key!r} of the Trainer's layout is not in "
                                  f"the snapshot")
        flat = np.ascontiguousarray(values[key]).reshape(-1)
        offset = 0
        for name, shape in params:
            n = int(np.prod(shape, dtype=np.int64))
            if offset + n > flat.size:
                raise CheckpointError(f"{path}: key {key!r} holds {flat.size} values, "
                                      f"fewer than its parameters need")
            tensors[name] = torch_tensor(flat[offset:offset + n].reshape(shape).copy())
            offset += n
    return tensors


def _tied_names(saved: dict, path) -> dict[str, str]:
    """{name: the name it is tied to} of the parameters a Trainer's snapshot records under
    several names (`saved`: its worker 0's user_state); {} for a snapshot taken before
    they were recorded."""
    tied = saved["trainer"].get("tied") or {}
    if not isinstance(tied, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        raise CheckpointError(f"{path}: the Trainer's tied parameter names are damaged")
    return dict(tied)


def export_safetensors(snapshot, out) -> list[str]:
    """Write the parameters and buffers of a Trainer's snapshot to `out` in safetensors
    (written whole, fsynced, then renamed: a failed or interrupted export leaves no half
    file and no temporary one; a killed one, at worst a hidden folder
    `.<name>.<random letters>.tmp` beside it); their names. CheckpointError, naming
    `out`, when it cannot be written (checked before the snapshot is read where it can
    be: a missing folder, a folder in its place)."""
    from safetensors.torch import save_file
    out = _checked_out(os.fspath(out))
    tensors, tied, path = snapshot_tensors(snapshot)
    apart = _apart(tensors)
    # the tied names, as safetensors' `save_model` records the names it drops
    metadata = {"gpukv.snapshot": os.fspath(path), **tied}
    _write_whole(out, lambda temp: save_file(apart, temp, metadata=metadata))
    return list(tensors)


def _checked_out(out: str) -> str:
    """`out`, when an export can be written there; else CheckpointError naming it."""
    folder = os.path.dirname(out) or "."
    if os.path.isdir(out):
        raise CheckpointError(f"{out}: is a folder; name the .safetensors file to write")
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise CheckpointError(f"{out}: cannot write the export: its folder {folder} {what}")
    return out


def _write_whole(out: str, write) -> None:
    """`write(temp)` a file in a temporary folder beside `out`, then fsync it, rename it
    over `out` (over the file a symlink `out` names: the link stays a link) and fsync
    the folder, as `atomic_write` does. The folder, hidden and named after `out`
    (`.<name>.<random letters>.tmp`), is this call's own: exports to one `out` at once
    each write their own (the last renamed is `out`), and a killed one leaves it beside
    `out`. On any failure it is removed, and an OS or safetensors error is a
    CheckpointError naming `out`."""
    from safetensors import SafetensorError
    target = os.path.realpath(out)
    folder, name = os.path.split(target)
    mode = file_mode(out)  # (safetensors makes its file 0o600)
    temp_folder = None
    try:  # the name is shortened so that the temporary name stays within NAME_MAX
        temp_folder = tempfile.mkdtemp(prefix=f".{name[:100]}.", suffix=".tmp", dir=folder)
        # safetensors writes a temporary file of its own beside the one it is given, and
        # renames it: in this folder, a killed export's leftovers stay in one place (a
        # folder, not `safetensors.torch.save`'s bytes: those are a second copy of the
        # whole model in memory)
        temp = os.path.join(temp_folder, name)
        write(temp)
        fd = os.open(temp, os.O_RDONLY)
        try:
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, target)
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"{out}: cannot write the export: {exc}") from None
    finally:
        if temp_folder is not None:  # (empty after the rename)
            shutil.rmtree(temp_folder, ignore_errors=True)
    _fsync_dir(folder)


def _apart(tensors: dict) -> dict:
    """`tensors` with no two sharing memory (safetensors refuses those): a tensor whose
    memory an earlier one holds is written as a copy of its own."""
    seen: set = set()
    apart = {}
    for name, tensor in tensors.items():
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        apart[name] = tensor.clone() if tensor.numel() and storage in seen else tensor
        seen.add(storage)
    return apart
