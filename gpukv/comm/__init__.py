"""Reduction strategies: how a key's values meet on its home device and go back."""
from ._base import BroadcastJob, ReduceJob, Strategy
from .host import HostStrategy

__all__ = ["Strategy", "ReduceJob", "BroadcastJob", "HostStrategy"]
