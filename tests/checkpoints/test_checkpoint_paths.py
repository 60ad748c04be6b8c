"""Checkpoint paths and disks that fail: save, load, save_optimizer_states and
load_optimizer_states raise CheckpointError naming the path and the cause (chained from the
OS error), leave the previous file whole with no temporary file, and change no store."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import gpukv
from gpukv import optim

from .failing_file import FailingFile

SAVES = {
    "save": lambda kv, path: kv.save(path),
    "save_optimizer_states": lambda kv, path: kv.save_optimizer_states(path),
}
LOADS = {
    "load": lambda kv, path: kv.load(path),
    "load_optimizer_states": lambda kv, path: kv.load_optimizer_states(path),
}
KEYS = [1, 2]


def _store(scale=1.0):
    kv = gpukv.create("local")
    kv.init(KEYS, [np.full((3, 4), scale, np.float32), np.full(5, scale, np.float32)])
    kv.set_optimizer(optim.Adam(learning_rate=0.1))
    kv.push(KEYS, [np.full((3, 4), 0.5, np.float32), np.full(5, -0.5, np.float32)])
    return kv


def _fingerprint(kv):
    """The store's values and its optimizer's whole exported state."""
    outs = [np.empty((3, 4), np.float32), np.empty(5, np.float32)]
    kv.pull(KEYS, out=outs)
    header, arrays = kv._updater.export_state(dump_optimizer=True)
    return [o.tobytes() for o in outs], header, {k: a.tobytes() for k, a in arrays.items()}


def _files(folder):
    return sorted(p.name for p in folder.iterdir())


# ----------------------------------------------------------------------------- saving
@pytest.mark.parametrize("door", SAVES)
def test_save_to_a_folder(tmp_path, door):
    """Saving onto a folder is a CheckpointError naming it; nothing is written."""
    (tmp_path / "inside").mkdir()
    with pytest.raises(gpukv.CheckpointError, match="is a folder") as caught:
        SAVES[door](_store(), tmp_path / "inside")
    assert str(tmp_path / "inside") in str(caught.value)
    assert isinstance(caught.value.__cause__, IsADirectoryError)
    assert _files(tmp_path) == ["inside"] and _files(tmp_path / "inside") == []


@pytest.mark.parametrize("door", SAVES)
def test_save_to_an_empty_path(tmp_path, monkeypatch, door):
    """An empty path is a CheckpointError; nothing is written in the working folder or
    the one above it."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(gpukv.CheckpointError, match="empty path"):
        SAVES[door](_store(), "")
    assert _files(tmp_path) == ["work"] and _files(work) == []


@pytest.mark.parametrize("door", SAVES)
@pytest.mark.parametrize("path", [None, 3, 2.5, ["ck.npz"]], ids=repr)
def test_save_to_something_not_a_path(door, path):
    """None or any other object that is not a path is a CheckpointError that is also a
    TypeError (a wrong kind), naming what it got; not Python's own error."""
    with pytest.raises(gpukv.CheckpointError, match="expected a str or an os.PathLike") as info:
        SAVES[door](_store(), path)
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("door", SAVES)
def test_save_in_a_missing_folder(tmp_path, door):
    """A path in a folder that does not exist is a CheckpointError chained from the OS's."""
    path = tmp_path / "missing" / "ck.npz"
    with pytest.raises(gpukv.CheckpointError, match="No such file or directory") as caught:
        SAVES[door](_store(), path)
    assert str(path) in str(caught.value)
    assert isinstance(caught.value.__cause__, FileNotFoundError)
    assert _files(tmp_path) == []


@pytest.fixture
def read_only(tmp_path, monkeypatch):
    """A folder nothing can be created in (made read-only, and refused by os.open too, for
    a root user whom the mode would not stop)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    real = os.open

    def guarded(path, flags, *args, **kwargs):
        where = os.path.dirname(os.path.abspath(os.fsdecode(path)))
        if where == str(folder) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded)
    folder.chmod(0o555)
    yield folder
    folder.chmod(0o755)


@pytest.mark.parametrize("door", SAVES)
def test_save_in_a_read_only_folder(read_only, door):
    """A folder that cannot be written is a CheckpointError chained from PermissionError."""
    path = read_only / "ck.npz"
    with pytest.raises(gpukv.CheckpointError, match="Permission denied") as caught:
        SAVES[door](_store(), path)
    assert str(path) in str(caught.value)
    assert isinstance(caught.value.__cause__, PermissionError)
    assert _files(read_only) == []


def _fail(monkeypatch, where, size):
    """Make the next save fail with ENOSPC at `where`: after 0, half or all but one of
    `size` bytes, when the file is fsynced, or when it is renamed into place."""
    if where == "rename":
        def refuse(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(os, "replace", refuse)
        return
    if where == "fsync":
        real_fsync = os.fsync

        def fsync(fd):
            if os.path.isfile(f"/proc/self/fd/{fd}"):  # the file, not its folder
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_fsync(fd)
        monkeypatch.setattr(os, "fsync", fsync)
        return
    budget = {"start": 0, "middle": size // 2, "end": size - 1}[where]
    real = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: FailingFile(real(*a, **k), budget))


@pytest.mark.parametrize("door", SAVES)
@pytest.mark.parametrize("where", ["start", "middle", "end", "fsync", "rename"])
def test_full_disk_keeps_the_previous_file(tmp_path, monkeypatch, door, where):
    """A disk that fills up anywhere during a save raises CheckpointError (naming the path,
    chained from the ENOSPC OSError); the previous file stays whole, no temporary file."""
    path = tmp_path / "ck.npz"
    kv = _store()
    SAVES[door](kv, path)
    before = path.read_bytes()
    kv.push(KEYS, [np.ones((3, 4), np.float32), np.ones(5, np.float32)])
    _fail(monkeypatch, where, len(before))
    with pytest.raises(gpukv.CheckpointError, match="No space left on device") as caught:
        SAVES[door](kv, path)
    assert str(path) in str(caught.value)
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.ENOSPC
    assert path.read_bytes() == before
    assert _files(tmp_path) == ["ck.npz"]
    monkeypatch.undo()  # the disk has room again: the store saves and loads as usual
    SAVES[door](kv, path)
    fresh = _store(scale=7.0)
    LOADS["load" if door == "save" else "load_optimizer_states"](fresh, path)
    assert _fingerprint(fresh)[1:] == _fingerprint(kv)[1:]


# ---------------------------------------------------------------------------- loading
def _bad_load_path(tmp_path, bad):
    (tmp_path / "folder").mkdir(exist_ok=True)
    return {"none": None, "empty": "", "int": 7, "folder": tmp_path / "folder",
            "missing_folder": tmp_path / "missing" / "ck.npz",
            "missing_file": tmp_path / "ck.npz", "nul": str(tmp_path / "a\0b")}[bad]


@pytest.mark.parametrize("door", LOADS)
@pytest.mark.parametrize("bad", ["none", "empty", "int", "folder", "missing_folder",
                                 "missing_file", "nul"])
def test_load_from_a_bad_path_changes_nothing(tmp_path, door, bad):
    """Loading from None, '', a non-path, a folder or a missing file is a CheckpointError
    naming the path, never a TypeError or an OSError; the store is left as it was."""
    kv = _store()
    before = _fingerprint(kv)
    path = _bad_load_path(tmp_path, bad)
    with pytest.raises(gpukv.CheckpointError) as caught:
        LOADS[door](kv, path)
    if bad in ("folder", "missing_folder", "missing_file"):
        assert str(path) in str(caught.value)
        assert isinstance(caught.value.__cause__, OSError)
    assert _fingerprint(kv) == before


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
@pytest.mark.parametrize("call", sorted(SAVES) + ["snapshot"])
def test_a_file_written_has_a_new_files_permissions_or_the_old_ones(tmp_path, call, umask):
    """A new file gets what `open` would give it (0o666 less the umask), not the 0o600 of
    the temporary file it was written as; a file written over keeps its own."""
    kv = _store()
    before = os.umask(umask)
    try:
        if call == "snapshot":
            kv.snapshot(tmp_path / "snaps", step=1)
            kv.finish_snapshots()
            written = [p for p in (tmp_path / "snaps").rglob("*") if p.is_file()]
        else:
            SAVES[call](kv, tmp_path / "f")
            written = [tmp_path / "f"]
        assert written and all(p.stat().st_mode & 0o777 == 0o666 & ~umask for p in written)
        if call != "snapshot":
            os.chmod(tmp_path / "f", 0o604)
            SAVES[call](kv, tmp_path / "f")
            assert (tmp_path / "f").stat().st_mode & 0o777 == 0o604
    finally:
        os.umask(before)


@pytest.mark.parametrize("call", sorted(SAVES))
def test_a_save_through_a_symlink_writes_its_target_and_keeps_the_link(tmp_path, call):
    """As open() does: the link's target gets the new file (in the target's folder) and
    the link stays a link to it; a load through the link reads it."""
    kv = _store()
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "f"
    target.write_bytes(b"old")
    link = tmp_path / "link"
    link.symlink_to(target)
    SAVES[call](kv, link)
    assert link.is_symlink() and link.resolve() == target
    assert target.read_bytes() != b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    other = _store(scale=2.0)
    LOADS[call.replace("save", "load")](other, link)
    read = slice(None) if call == "save" else slice(1, None)  # (states only: no values)
    assert _fingerprint(other)[read] == _fingerprint(kv)[read]
