"""Fixtures of the kernel emulation's tests."""
from __future__ import annotations

import pytest

from .support import kernels


@pytest.fixture
def address_describer():
    """Installs a describer (or None) for the test's duration, then puts back whichever
    was there (the emulated memory may have installed its own)."""
    installed = []

    def install(fn):
        installed.append(kernels.set_address_describer(fn))

    yield install
    if installed:
        kernels.set_address_describer(installed[0])
