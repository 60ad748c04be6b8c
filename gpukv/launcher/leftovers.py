"""The files MPICH leaves on a host when a job's processes end without MPI_Finalize (a
rank killed, ended by os._exit or a crash, a job ended by force): each rank's
shared-memory segments (/dev/shm/mpich_shm_*, about 1 MB each) and each proxy's copy of
the host's topology (/tmp/hydra_hwloc_xmlfile_*). Plain mpiexec leaves them too; a
launcher that restarts failed jobs would pile them up until /dev/shm is full, so each
attempt removes, on this host, those that appeared while it ran and that no process
holds open or mapped (another job's, still running, are held by its processes)."""
from __future__ import annotations

import os
from pathlib import Path

#: (folder, pattern) of what MPICH's ranks and hydra's proxies leave
PLACES = ((Path("/dev/shm"), "mpich_shm_*"), (Path("/tmp"), "hydra_hwloc_xmlfile_*"))
_PROC = Path("/proc")


def present() -> set[Path]:
    """Such files of this user's that are there now."""
    uid = os.getuid()
    found = set()
    for folder, pattern in PLACES:
        try:
            for path in folder.glob(pattern):
                try:
                    if path.lstat().st_uid == uid:
                        found.add(path)
                except OSError:  # removed meanwhile
                    continue
        except OSError:
            continue
    return found


def held() -> set[str]:
    """The paths any process this user can see holds open or has mapped."""
    paths: set[str] = set()
    for entry in _PROC.iterdir() if _PROC.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                try:
                    paths.add(os.readlink(fd))
                except OSError:
                    continue
            with open(entry / "maps") as maps:
                for line in maps:
                    fields = line.split(None, 5)
                    if len(fields) == 6:
                        paths.add(fields[5].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:  # ended meanwhile, or another user's
            continue
    return paths


def remove_new(before: set[Path]) -> list[Path]:
    """Remove the files of `present()` that were not in `before` and that no process
    holds; the paths removed."""
    new = present() - before
    if not new:  # (a job that ended well leaves none: no walk of /proc)
        return []
    try:
        busy = held()
    except OSError:  # (what is held cannot be known: remove nothing)
        return []
    removed = []
    for path in sorted(new):
        if str(path) in busy or os.path.realpath(path) in busy:
            continue
        try:
            path.unlink()
        except OSError:  # removed meanwhile, or not ours to remove
            continue
        removed.append(path)
    return removed
