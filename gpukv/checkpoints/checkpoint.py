"""Checkpoint files: crash-safe writes and a versioned archive of arrays with a JSON header.

An archive is a plain `.npz` file (an uncompressed zip of `.npy` members, readable with
`numpy.load(path, allow_pickle=False)`), never a pickle:

- member `__gpukv__.npy`: a uint8 array holding UTF-8 JSON
  `{"format": "gpukv-archive", "version": 1, "header": {...}, "arrays": {name: meta}}`,
  where `header` is the caller's JSON object and `meta` is
  `{"dtype": "bfloat16", "stored_as": "uint16", "shape": [2, 3], "crc32": 123}`;
- member `<name>.npy` for each array. Dtypes NumPy cannot write by itself (bfloat16 and
  the other ml_dtypes types) are stored as their raw bits in an unsigned integer of the
  same width and given back with their own dtype.

Files are written through `atomic_write`: a temporary file in the same folder, flushed and
fsynced, then `os.replace`d over the target and the folder fsynced, so a crash at any
point leaves either the previous file or the new one, whole; the new one has the
permissions the previous one had, or a new file's (0o666 less the umask). Every problem
with a path or a file (no path, a folder, a missing or read-only folder, a full disk; a
missing, truncated, corrupt or foreign file, a newer version) raises CheckpointError
naming the path and the cause, chained from the OS error when there is one.

Whole stores: `KVStore.save` hands `save_store` a `StoreSnapshot` (every key in order with
its value and home kind, and the store's optimizer updater); `KVStore.load` reads the file
with `read_store` (outside the store's lock), turns it into a `LoadPlan` with `plan_load`
against a snapshot of the store (checking everything, optimizer state included), and
applies the plan, both under one hold of its lock. This module never sees a KVStore.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import io
import json
import logging
import math
import mmap
import os
import re
import stat
import struct
import tempfile
import zipfile
import zlib
from typing import Any, NamedTuple

import numpy as np

from .._dtypes import SUPPORTED_DTYPES
from .._errors import CheckpointError, CheckpointPathKindError

__all__ = ["atomic_write", "write_archive", "read_archive", "checkpoint_path",
           "StoreSnapshot", "StoreFile", "LoadPlan", "save_store", "read_store", "plan_load",
           "ARCHIVE_FORMAT", "ARCHIVE_VERSION", "STORE_KIND", "STORE_VERSION"]

log = logging.getLogger("gpukv")

ARCHIVE_FORMAT = "gpukv-archive"
ARCHIVE_VERSION = 1
STORE_KIND = "gpukv.api.store"  # the file format's name, kept as the first files had it
STORE_VERSION = 1

_HEADER_MEMBER = "__gpukv__"
_PART = r"(?!\.\.?(?:/|\Z))[A-Za-z0-9_.\-]+"  # no empty, '.' or '..' part
_NAME = re.compile(rf"(?=.{{1,200}}\Z){_PART}(?:/{_PART})*")
_INT_KEY = re.compile(r"0|-?[1-9][0-9]*")  # how str(int) writes an int key, nothing else
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_LOCAL_HEADER = b"PK\x03\x04"


# ----------------------------------------------------------------------------- paths
def checkpoint_path(path) -> str:
    """`path` (a str, bytes or os.PathLike) as a str; CheckpointError for None, an empty
    path, a NUL character or anything that is not a path."""
    try:
        text = os.fsdecode(os.fspath(path))
    except TypeError as exc:
        raise CheckpointPathKindError(f"checkpoint path {_show(path)}: expected a str or "
                                      f"an os.PathLike, got {type(path).__name__}") from exc
    if not text:
        raise CheckpointError("checkpoint path '': an empty path names no file")
    if "\0" in text:
        raise CheckpointError(f"checkpoint path {_show(text)}: contains a NUL character")
    return text


def _show(value, limit: int = 80) -> str:
    """`repr(value)` for messages: shortened when long, and never a ValueError (an int
    beyond Python's int-to-str digit limit is described by its size)."""
    try:
        text = repr(value)
    except ValueError:
        return f"<an int of about {int(value.bit_length() * math.log10(2)) + 1} digits>"
    return text if len(text) <= limit else f"{text[:limit - 20]}... ({len(text)} characters)"


def _reason(exc: OSError) -> str:
    """The OS's words for `exc`, without the temporary file names it may carry."""
    return exc.strerror or str(exc) or type(exc).__name__


# --------------------------------------------------------------------------- atomic writes
def _fsync_dir(folder: str) -> None:
    """Make a rename in `folder` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems without directory fsync
        pass
    finally:
        os.close(fd)


def file_mode(path: str) -> int:
    """The permission bits a file written over `path` gets: the file's own where it
    exists, else what `open` would give a new one (0o666 less the umask). A temporary
    file is made 0o600, and renamed over `path` it would keep that: a snapshot or an
    export that another account, or a serving container, could not read."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read where Linux shows it (setting it to read it back would
    change it for every thread meanwhile)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write(path):
    """Open a binary file that replaces `path` only once it is complete and on disk.

    `with atomic_write(path) as f: f.write(...)` writes a temporary file in the folder of
    `path`; on a clean exit it is flushed, fsynced, renamed over `path` (atomic) and the
    folder is fsynced. On an exception the temporary file is removed and `path` is left
    untouched; an OS error (a full disk, a folder that cannot be written, `path` a folder)
    becomes a CheckpointError naming `path` and the cause. A process killed meanwhile
    leaves `path` untouched and, at worst, a stray `.<name>.*.tmp` file beside it.
    """
    path = checkpoint_path(path)
    if os.path.isdir(path):  # found before writing a whole file that could not be renamed
        raise CheckpointError(f"{path}: is a folder; a checkpoint needs a file name") from (
            IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path))
    # a symlink's target is what is written (the link stays a link, as open() leaves it)
    target = os.path.realpath(path)
    folder, name = os.path.split(target)
    try:  # the name is shortened so that the temporary name stays within NAME_MAX
        fd, tmp = tempfile.mkstemp(prefix=f".{name[:100]}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot write a checkpoint there: "
                              f"{_reason(exc)}") from exc
    try:
        os.fchmod(fd, file_mode(path))
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise CheckpointError(f"{path}: the checkpoint could not be written: "
                                  f"{_reason(exc)}; the previous file is unchanged") from exc
        raise
    _fsync_dir(folder)


# ------------------------------------------------------------------------------- archives
_DTYPE_NAMES: dict = {}  # np.dtype -> its name


def _restore_dtype(name) -> np.dtype:
    """The dtype called `name`, looking in ml_dtypes for the ones NumPy lacks."""
    if not isinstance(name, str):
        raise CheckpointError(f"dtype {_show(name)} is not a dtype name")
    return _named_dtype(name)


@functools.lru_cache(maxsize=256)
def _named_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        pass
    try:
        import ml_dtypes
    except ImportError as exc:
        raise CheckpointError(
            f"dtype {name!r} needs the ml_dtypes package: pip install ml_dtypes") from exc
    found = getattr(ml_dtypes, name, None)
    if found is None:
        raise CheckpointError(f"unknown dtype {_show(name)}")
    return np.dtype(found)


def _storable(array: np.ndarray) -> tuple[np.ndarray, str | None]:
    """`array` as NumPy can write it without pickling, and the integer type used if any."""
    kind = array.dtype.kind
    if kind in "biufc":  # byte-swapped arrays are stored in native order
        native = array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))
        return native, None
    if kind == "V" and not array.dtype.fields and array.dtype.itemsize in _UINT:
        bits = _UINT[array.dtype.itemsize]
        return array.view(bits), np.dtype(bits).name  # bfloat16 & co: their raw bits
    raise CheckpointError(f"dtype {array.dtype} cannot be stored in a checkpoint")


def _contiguous(array: np.ndarray) -> np.ndarray:
    return array if array.flags.c_contiguous else array.copy(order="C")  # keeps 0-d arrays


def _bytes(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, as a flat uint8 view (0-d arrays too)."""
    return array.reshape(-1).view(np.uint8)


def _crc(array: np.ndarray) -> int:
    # a uint8 ndarray is a buffer; the stubs ask for `Buffer`, which ndarray does not declare
    return zlib.crc32(_bytes(_contiguous(array))) & 0xFFFFFFFF  # type: ignore[arg-type]


@functools.lru_cache(maxsize=1024)
def _npy_header(dtype: np.dtype, shape: tuple) -> bytes:
    """The header `numpy.lib.format.write_array` writes before a C-ordered array."""
    fields = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
              "shape": shape}
    buf = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buf, fields)
    except ValueError:  # a header beyond 64 KiB (thousands of dimensions)
        buf = io.BytesIO()
        np.lib.format.write_array_header_2_0(buf, fields)
    return buf.getvalue()


def _bad_name(name) -> bool:
    return not isinstance(name, str) or not _NAME.fullmatch(name) or name == _HEADER_MEMBER


def write_archive(path, header: dict, arrays: dict) -> None:
    """Write `arrays` ({name: NumPy array}) and the JSON object `header` to `path`, atomically.

    Names are 1-200 characters of letters, digits and `_ . - /`. The arrays must be NumPy
    arrays (copy GPU arrays to the host first).
    """
    path = checkpoint_path(path)
    manifest = {}
    prepared = []
    for name, array in arrays.items():
        if _bad_name(name):
            raise CheckpointError(f"array name {_show(name)}: use 1-200 of [A-Za-z0-9_.-/], "
                                  f"no empty, '.' or '..' parts")
        if not isinstance(array, np.ndarray):
            raise CheckpointError(
                f"array {name!r}: expected a NumPy array, got {type(array).__name__}")
        array = _contiguous(array)
        stored, stored_as = _storable(array)
        manifest[name] = {"dtype": _dtype_name(array.dtype), "stored_as": stored_as,
                          "shape": list(array.shape), "crc32": _crc(stored)}
        prepared.append((name, stored))
    try:
        text = json.dumps({"format": ARCHIVE_FORMAT, "version": ARCHIVE_VERSION,
                           "header": header, "arrays": manifest},
                          allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: header is not plain JSON: {exc}") from exc
    header_bytes = np.frombuffer(text.encode("utf-8"), np.uint8)
    with atomic_write(path) as f:
        # the stubs want close(), which zipfile never calls on a file object it was given
        with zipfile.ZipFile(_Appending(f), "w", zipfile.ZIP_STORED,  # type: ignore[call-overload]
                             allowZip64=True) as zf:
            _write_member(zf, _HEADER_MEMBER, header_bytes)
            for name, stored in prepared:
                _write_member(zf, name, stored)


def _dtype_name(dtype: np.dtype) -> str:
    """`dtype.name`, remembered (NumPy computes it anew on every call)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.name
    return name


class _Appending:
    """A file zipfile can only append to: it then writes each member's sizes and checksum
    after its data (a standard data descriptor) instead of seeking back to its header,
    which costs a flush and two seeks per member (a third of a save of many small keys)."""

    def __init__(self, f):
        self._f = f
        self._at = f.tell()

    def write(self, data) -> int:
        written = self._f.write(data)
        self._at += written
        return written

    def tell(self) -> int:
        return self._at

    def flush(self) -> None:
        self._f.flush()


def _write_member(zf: zipfile.ZipFile, name: str, stored: np.ndarray) -> None:
    """Member `<name>.npy`: the bytes `numpy.save` would write for the C-ordered `stored`."""
    head = _npy_header(stored.dtype, stored.shape)
    info = zipfile.ZipInfo(name + ".npy")  # dated 1980-01-01: a store saves to the same bytes
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = len(head) + stored.nbytes  # known: zip64 fields only when needed
    with zf.open(info, "w") as member:
        member.write(head)
        if stored.nbytes:
            member.write(_bytes(stored))  # type: ignore[call-overload]  # ndarray is a buffer


class _Members:
    """The `.npy` members of an open archive.

    A stored (uncompressed) member laid out as `write_archive` writes it is read straight
    from a memory map of the file: the central directory gives its place, and its header
    must be the very bytes NumPy writes for the expected dtype and shape. Anything else
    (compressed members, other headers, Fortran order) is read by zipfile and NumPy.
    Either way each array is a fresh copy.
    """

    def __init__(self, f, zf: zipfile.ZipFile):
        self.zf = zf
        self.infos = {info.filename: info for info in zf.infolist()}
        self.map: mmap.mmap | None
        try:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # a file that cannot be mapped: zipfile reads it all
            self.map = None

    def close(self) -> None:
        if self.map is not None:
            self.map.close()

    def has(self, name: str) -> bool:
        return name + ".npy" in self.infos

    def read(self, name: str, dtype: np.dtype | None = None, shape: tuple | None = None):
        """Member `name` as an array; `dtype` and `shape`: what the manifest says it is."""
        info = self.infos[name + ".npy"]
        if dtype is not None and shape is not None:
            mapped = self._mapped(info, dtype, shape)
            if mapped is not None:
                return mapped
        with self.zf.open(info) as member:
            return np.lib.format.read_array(member, allow_pickle=False)

    def _mapped(self, info: zipfile.ZipInfo, dtype: np.dtype, shape: tuple):
        view = self.map
        if (view is None or info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1
                or dtype.kind not in "biufc"):
            return None
        head = _npy_header(dtype, shape)
        count = math.prod(shape)
        at = info.header_offset
        if info.file_size != len(head) + count * dtype.itemsize or at + 30 > len(view):
            return None
        if view[at:at + 4] != _LOCAL_HEADER:
            return None
        name_len, extra_len = struct.unpack_from("<HH", view, at + 26)
        start = at + 30 + name_len + extra_len
        if start + info.file_size > len(view) or view[start:start + len(head)] != head:
            return None
        if count == 0:
            return np.empty(shape, dtype)
        return np.frombuffer(view, dtype, count, start + len(head)).reshape(shape).copy()


def read_archive(path, wanted=None) -> tuple[dict, dict]:
    """`(header, arrays)` from an archive written by `write_archive`, checked whole
    (with `wanted`, a test of an array's name: only the arrays it passes are read).

    Raises CheckpointError for a bad path, a missing, unreadable, truncated, corrupt or
    foreign file, or one written by a newer version of the format. Linear in the number
    of arrays.
    """
    path = checkpoint_path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: no such checkpoint file") from exc
    except IsADirectoryError as exc:
        raise CheckpointError(f"{path}: is a folder, not a checkpoint file") from exc
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint: {_reason(exc)}") from exc
    with f:
        try:
            zf = zipfile.ZipFile(f)
        except zipfile.BadZipFile as exc:
            raise CheckpointError(f"{path}: not a gpukv checkpoint, or a damaged one (not "
                                  f"a complete zip archive)") from exc
        except Exception as exc:  # OS errors, oddities of the zip reader
            raise CheckpointError(f"{path}: unreadable or damaged checkpoint: "
                                  f"{type(exc).__name__}: {exc}") from exc
        with zf:
            members = _Members(f, zf)
            try:
                return _read_contents(path, members, wanted)
            except CheckpointError:
                raise
            except Exception as exc:  # zipfile, numpy.format, json, unicode, OS errors
                raise CheckpointError(f"{path}: unreadable or damaged checkpoint: "
                                      f"{type(exc).__name__}: {exc}") from exc
            finally:
                members.close()


def _read_contents(path: str, members: _Members, wanted=None) -> tuple[dict, dict]:
    if not members.has(_HEADER_MEMBER):
        raise CheckpointError(f"{path}: not a gpukv checkpoint (no {_HEADER_MEMBER})")
    meta = json.loads(members.read(_HEADER_MEMBER).tobytes().decode("utf-8"))
    if not isinstance(meta, dict) or meta.get("format") != ARCHIVE_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise CheckpointError(f"{path}: not a gpukv checkpoint (format {_show(found)})")
    version = meta.get("version")
    if type(version) is not int or version > ARCHIVE_VERSION or version < 1:
        raise CheckpointError(f"{path}: archive version {_show(version)} is not supported "
                              f"(this gpukv reads up to {ARCHIVE_VERSION})")
    header, manifest = meta.get("header"), meta.get("arrays")
    if not isinstance(header, dict) or not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: damaged archive header")
    arrays = {name: _read_member(path, members, name, info)
              for name, info in manifest.items() if wanted is None or wanted(name)}
    return header, arrays


def _shape(value) -> tuple | None:
    """A manifest's shape as a tuple of sizes, or None when it is not one."""
    if not isinstance(value, list) or not all(type(n) is int and n >= 0 for n in value):
        return None
    return tuple(value)


def _read_member(path: str, members: _Members, name: str, info) -> np.ndarray:
    if _bad_name(name) or not members.has(name) or not isinstance(info, dict):
        raise CheckpointError(f"{path}: array {_show(name)} is missing")
    shape = _shape(info.get("shape"))
    if shape is None:
        raise CheckpointError(f"{path}: array {name!r} is damaged (bad shape)")
    dtype = _restore_dtype(info.get("dtype"))
    stored_as = info.get("stored_as")
    want = dtype if stored_as is None else _restore_dtype(stored_as)
    if want.kind not in "biufc":
        raise CheckpointError(f"{path}: array {name!r} has a foreign dtype {want}")
    if stored_as is not None and (want.kind != "u" or want.itemsize != dtype.itemsize):
        raise CheckpointError(f"{path}: array {name!r} is damaged (dtype differs)")
    stored = members.read(name, want, shape)
    if stored.dtype.kind not in "biufc":
        raise CheckpointError(f"{path}: array {name!r} has a foreign dtype {stored.dtype}")
    if stored.shape != shape or _crc(stored) != info.get("crc32"):
        raise CheckpointError(f"{path}: array {name!r} is damaged (shape or checksum differ)")
    if stored.dtype != want:
        raise CheckpointError(f"{path}: array {name!r} is damaged (dtype differs)")
    return stored if stored_as is None else stored.view(dtype)


# ------------------------------------------------------------------------ whole stores
class StoreSnapshot(NamedTuple):
    """A store as a checkpoint sees it (made by `KVStore._snapshot` under its lock)."""
    store_type: str
    key_kind: type | None   # int, str, or None while the store is empty
    entries: list           # (key, value, home kind) of every key, in init order
    updater: Any            # the OptimizerUpdater of `set_optimizer`, or None


class StoreFile(NamedTuple):
    """What a store checkpoint holds, checked on its own (not yet against a store)."""
    path: str
    key_kind: type | None
    keys: list
    homes: list             # the kind of each key's home when it was saved
    values: list            # NumPy arrays
    optimizer: tuple | None  # (header, arrays) of the optimizer's state


class LoadPlan(NamedTuple):
    """A load checked against a store: applying it cannot fail on the file's content."""
    key_kind: type | None   # the key kind the store takes on (None: unchanged)
    updates: list           # (key, value) of keys the store holds
    creates: list           # (key, value, home kind) of keys the load creates
    optimizer: object       # the updater's checked state (`check_state`), or None


def save_store(snapshot: StoreSnapshot, path) -> None:
    """Write every key of a store (and its optimizer's state) to `path`; see `KVStore.save`.

    The snapshot's values must stay unchanged while this runs (the store holds its lock).
    """
    path = checkpoint_path(path)
    kind = snapshot.key_kind
    arrays, keys, homes = {}, [], []
    for i, (key, value, home) in enumerate(snapshot.entries):
        arrays[f"value/{i}"] = value
        keys.append(_key_text(path, key))
        homes.append(home)
    optimizer = None
    if snapshot.updater is not None:
        opt_header, opt_arrays = snapshot.updater.export_state()
        optimizer = {"header": opt_header, "arrays": list(opt_arrays)}
        for name, array in opt_arrays.items():
            arrays[f"optimizer/{name}"] = array
    header = {"kind": STORE_KIND, "version": STORE_VERSION, "store_type": snapshot.store_type,
              "key_kind": kind.__name__ if kind is not None else None, "keys": keys,
              "homes": homes, "optimizer": optimizer}
    write_archive(path, header, arrays)


def _key_text(path: str, key) -> str:
    if isinstance(key, str):
        return key
    try:
        return str(key)
    except ValueError as exc:  # beyond sys.get_int_max_str_digits()
        raise CheckpointError(f"{path}: key {_show(key)} has too many digits to be "
                              f"saved: {exc}") from exc


def read_store(path) -> StoreFile:
    """Read and check a file `save_store` wrote (the file alone; see `plan_load`)."""
    path = checkpoint_path(path)
    header, arrays = read_archive(path)
    return _parse_store(path, header, arrays)


def _parse_store(path: str, header: dict, arrays: dict) -> StoreFile:
    if header.get("kind") != STORE_KIND:
        raise CheckpointError(
            f"{path}: a {_show(header.get('kind'))} archive, not a store checkpoint")
    version = header.get("version")
    if type(version) is not int or not 1 <= version <= STORE_VERSION:
        raise CheckpointError(f"{path}: store checkpoint version {_show(version)} is not "
                              f"supported (this gpukv reads up to {STORE_VERSION})")
    kind_name, raw_keys, homes = header.get("key_kind"), header.get("keys"), header.get("homes")
    if (kind_name not in ("int", "str", None) or not isinstance(raw_keys, list)
            or not isinstance(homes, list) or len(homes) != len(raw_keys)
            or not all(isinstance(k, str) for k in raw_keys)
            or not all(isinstance(h, str) for h in homes)
            or (kind_name is None and raw_keys)):
        raise CheckpointError(f"{path}: damaged store header")
    kind = {"int": int, "str": str, None: None}[kind_name]
    keys = [_int_key(path, k) for k in raw_keys] if kind is int else raw_keys
    if len(set(keys)) != len(keys):
        raise CheckpointError(f"{path}: damaged store header (a key appears twice)")
    values = []
    for i, key in enumerate(keys):
        value = arrays.get(f"value/{i}")
        if value is None:
            raise CheckpointError(f"{path}: the value of key {_show(key)} is missing")
        if _dtype_name(value.dtype) not in SUPPORTED_DTYPES:
            raise CheckpointError(
                f"{path}: key {_show(key)} has unsupported dtype {value.dtype}")
        values.append(value)
    return StoreFile(path, kind, keys, homes, values, _optimizer_section(path, header, arrays))


def _int_key(path: str, text: str) -> int:
    """An int key written by `save_store` (decimal, as `str` writes it)."""
    if not _INT_KEY.fullmatch(text):
        raise CheckpointError(f"{path}: damaged store header (int key {_show(text)})")
    try:
        return int(text)
    except ValueError as exc:  # beyond sys.get_int_max_str_digits()
        raise CheckpointError(f"{path}: damaged store header: an int key of {len(text)} "
                              f"digits: {exc}") from exc


def _optimizer_section(path: str, header: dict, arrays: dict):
    section = header.get("optimizer")
    if section is None:
        return None
    names = section.get("arrays") if isinstance(section, dict) else None
    if (not isinstance(names, list) or not all(isinstance(n, str) for n in names)
            or not isinstance(section.get("header"), dict)):
        raise CheckpointError(f"{path}: damaged optimizer section")
    opt_arrays = {}
    for name in names:
        array = arrays.get(f"optimizer/{name}")
        if array is None:
            raise CheckpointError(f"{path}: optimizer array {_show(name)} is missing")
        opt_arrays[name] = array
    return section["header"], opt_arrays


def plan_load(contents: StoreFile, snapshot: StoreSnapshot) -> LoadPlan:
    """Check a read file against a store (as `snapshot` shows it) and say what to change.

    Raises CheckpointError, changing nothing, for another key kind, a key whose shape or
    dtype differ from the store's, or optimizer state that does not fit the store's
    optimizer and the keys as they will be after the load. Linear in the keys.
    """
    path, kind = contents.path, contents.key_kind
    if kind is not None and snapshot.key_kind is not None and kind is not snapshot.key_kind:
        raise CheckpointError(f"{path}: holds {kind.__name__} keys but this store holds "
                              f"{snapshot.key_kind.__name__} keys")
    held = {key: value for key, value, _ in snapshot.entries}
    updates, creates = [], []
    for key, value, home in zip(contents.keys, contents.values, contents.homes):
        current = held.get(key)
        if current is None:
            creates.append((key, value, home))
        elif current.shape != value.shape or current.dtype != value.dtype:
            raise CheckpointError(
                f"{path}: key {_show(key)} is {value.dtype}{list(value.shape)} in the file "
                f"but {current.dtype}{list(current.shape)} in the store")
        else:
            updates.append((key, value))
    optimizer = None
    if contents.optimizer is not None and snapshot.updater is not None:
        weights = held  # every key as it will be after the load (shape and dtype)
        weights.update((key, value) for key, value, _ in creates)
        optimizer = _checked_optimizer(path, snapshot.updater, contents.optimizer, weights)
    elif contents.optimizer is not None:
        # (a warning: a program that loads before set_optimizer would train on with
        # fresh state, its momentum or Adam moments lost without a word)
        log.warning("gpukv: %s holds optimizer state but the store has no optimizer: only "
                    "the values were loaded; call set_optimizer before load to restore "
                    "the state too", path)
    return LoadPlan(kind, updates, creates, optimizer)


def _checked_optimizer(path: str, updater, optimizer, weights: dict):
    header, arrays = optimizer
    try:
        return updater.check_state(header, arrays, weights, path=path)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{path}: optimizer state does not fit this store's "
                              f"optimizer: {type(exc).__name__}: {exc}") from exc
