"""`python -m gpukv gpucheck`: check and measure gpukv on this machine's GPU in one command.

`cli` runs the sections and writes the record; `machine` finds the GPU (or the checkout's
CUDA emulation) and describes it; `suite` runs the checkout's GPU tests through
`pytest_plugin`; `kernel_cases` and `goldens` compare every kernel bit for bit with the
emulation's digests; `bandwidth`, `store_timing` and `trainer_timing` measure.
"""
