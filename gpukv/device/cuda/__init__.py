"""CUDA through CuPy: the device, streams, events, peer access, probes, NCCL, kernel sources."""
