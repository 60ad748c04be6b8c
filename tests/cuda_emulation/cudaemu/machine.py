"""The emulated machine: how many GPUs, which pairs have peer access, guard pages or not.

Read once from the environment when the emulation is imported (a subprocess can be given
another machine through its environment):

- `CUDAEMU_GPUS`: number of physical GPUs (default 2);
- `CUDAEMU_PEERS`: `all` (default), `none`, or pairs like `0-1,2-3` (both directions);
- `CUDAEMU_GUARD`: `1` (default) ends every device allocation at an inaccessible page and
  fills it with all-ones bytes (NaN, -1) first; `0` gives plain allocations.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Machine:
    gpus: int
    peers: frozenset  # ordered (a, b) pairs: a kernel on GPU a may read GPU b's memory
    guard: bool
    memory_bytes: int = 16 << 30
    name: str = "Emulated GPU (CPU)"

    def can_access_peer(self, reader: int, owner: int) -> bool:
        return reader == owner or (reader, owner) in self.peers


def _parse_peers(text: str, gpus: int) -> frozenset:
    text = text.strip().lower()
    if text in ("", "all"):
        return frozenset(itertools.permutations(range(gpus), 2))
    if text == "none":
        return frozenset()
    pairs = set()
    for part in text.split(","):
        a, b = (int(x) for x in part.split("-"))
        pairs.update({(a, b), (b, a)})
    return frozenset(pairs)


def from_environment() -> Machine:
    gpus = int(os.environ.get("CUDAEMU_GPUS", "2"))
    return Machine(gpus=gpus, peers=_parse_peers(os.environ.get("CUDAEMU_PEERS", "all"), gpus),
                   guard=os.environ.get("CUDAEMU_GUARD", "1") != "0")


MACHINE = from_environment()
