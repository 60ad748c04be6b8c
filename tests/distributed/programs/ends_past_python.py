"""A `gpukv run` job whose ranks end cleanly past Python's own exit, without MPI:
`ends_past_python.py os-exit` (each rank prints a line, then calls os._exit(0), as a
script skipping a slow teardown does) or `ends_past_python.py exec` (each rank prints a
line, then replaces itself with /bin/true)."""
import os
import sys

print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} ran", flush=True)
if sys.argv[1] == "exec":
    os.execv("/bin/true", ["true"])
os._exit(0)
