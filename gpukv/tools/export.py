"""`gpukv export SNAPSHOT OUT`: a Trainer snapshot's model parameters to a safetensors
file (`gpukv.torch.export` writes it). The command line is read here, apart from PyTorch,
so that `--help` and a wrong argument are answered where PyTorch is not installed."""
from __future__ import annotations

import argparse
import sys

from .._errors import ArgumentError, BackendError, CheckpointError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gpukv export",
        description="Write the model parameters of a Trainer's snapshot to a safetensors "
                    "file, under their own names (gpukv.torch.export.export_safetensors; "
                    "needs PyTorch and safetensors: the torch extra).")
    parser.add_argument("snapshot", help="a snapshot's folder, or a Trainer's "
                                         "checkpoint_dir (its newest snapshot)")
    parser.add_argument("out", help="the .safetensors file to write")
    args = parser.parse_args(argv)
    try:
        from ..torch.export import export_safetensors
    except BackendError as exc:  # no PyTorch
        print(f"gpukv export: {exc}", file=sys.stderr)
        return 2
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
