"""The digest program (programs/digest.py) from the tests: its DIGEST lines, and its run on
one process, the reference every layout is compared with."""
from __future__ import annotations

import re
import subprocess
import sys

from .. import gpu_env
from .mpirun import PROGRAMS


def digests(out: str) -> dict:
    """{what: sha1} of the DIGEST lines in a job's output."""
    return dict(re.findall(r"DIGEST (\w+) ([0-9a-f]{12})", out))


def one_process(store: str = "local", **env: str) -> dict:
    """The digests of a one-process store given all 8 leaves (`env`: the program's
    switches, e.g. DIGEST_COMPRESS='1')."""
    full = gpu_env.subprocess_env(gpus=False)
    full.update(env)
    result = subprocess.run([sys.executable, str(PROGRAMS / "digest.py"), "8", store],
                            capture_output=True, text=True, timeout=120, env=full)
    assert result.returncode == 0, result.stderr
    return digests(result.stdout)
