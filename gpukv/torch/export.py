"""`python -m gpukv export SNAPSHOT OUT.safetensors`: a Trainer's snapshot as a file other
tools open, its model's parameters under their own names (`model.state_dict()`'s), in
safetensors; `torch.load`-free: `safetensors.torch.load_file(OUT)` gives a dict that
`model.load_state_dict(...)` takes: the trained parameters, the parameters frozen when
the Trainer was made and the buffers (BatchNorm's running statistics), the last two as
worker 0's replica 0 had them. (A snapshot taken before snapshots kept frozen parameters
has none: `strict=False` then.)

The snapshot records which parameters each store key holds (a bucket fuses several, in
order, flat); the export cuts every key's value back into them. SNAPSHOT is a snapshot's
folder (`step-<step>-<tag>`) or a Trainer's `checkpoint_dir`, whose newest complete
snapshot is taken.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from .._errors import ArgumentError, CheckpointError
from ..checkpoints import snapshots
from .checkpoints import parameter_layout


def snapshot_tensors(snapshot) -> tuple[dict, snapshots.Snapshot | str]:
    """({parameter name: torch tensor}, the snapshot read) of a Trainer's snapshot (a
    folder, a Snapshot, or a checkpoint_dir: its newest)."""
    import torch
    path = os.fspath(snapshot)
    if not snapshots.is_snapshot(path):
        found = snapshots.latest_snapshot(path)
        if found is None:
            raise CheckpointError(f"{path}: no complete snapshot here (a snapshot's folder "
                                  f"is named step-<step>-<tag>)")
        path = found.path
    saved = snapshots.read_worker(path, 0)[1]
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
            tensors[name] = torch.from_numpy(flat[offset:offset + n].reshape(shape).copy())
            offset += n
    for kept in ("frozen", "buffers"):
        for name, tensor in (saved["trainer"].get(kept) or {}).items():
            tensors[name] = tensor.contiguous()
    return tensors, path


def export_safetensors(snapshot, out) -> list[str]:
    """Write the parameters and buffers of a Trainer's snapshot to `out` in safetensors
    (written whole, then renamed: an interrupted export leaves no half file); their
    names."""
    from safetensors.torch import save_file
    tensors, path = snapshot_tensors(snapshot)
    out = os.fspath(out)
    temp = f"{out}.tmp{os.getpid()}"
    save_file(tensors, temp, metadata={"gpukv.snapshot": os.fspath(path)})
    os.replace(temp, out)
    return list(tensors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gpukv export",
        description="Write the model parameters of a Trainer's snapshot to a safetensors "
                    "file, under their own names (see gpukv.torch.export).")
    parser.add_argument("snapshot", help="a snapshot's folder, or a Trainer's "
                                         "checkpoint_dir (its newest snapshot)")
    parser.add_argument("out", help="the .safetensors file to write")
    args = parser.parse_args(argv)
    try:
        names = export_safetensors(args.snapshot, args.out)
    except (CheckpointError, ArgumentError) as exc:
        print(f"gpukv export: {exc}", file=sys.stderr)
        return 1
    except ImportError as exc:
        print(f"gpukv export: {exc}; pip install safetensors (the torch extra has it)",
              file=sys.stderr)
        return 1
    print(f"gpukv export: {len(names)} tensors to {args.out}")
    return 0
