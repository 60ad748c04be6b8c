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
fsynced, then `os.replace`d over the target and the folder fsynced, so a crash at any point
leaves either the previous file or the new one, whole. Every problem reading a file (missing,
truncated, corrupt, foreign, newer version) raises CheckpointError naming the path.

`save_store` / `load_store` implement `KVStore.save` / `KVStore.load` on top of this.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import zipfile
import zlib

import numpy as np

from .._errors import CheckpointError

__all__ = ["atomic_write", "write_archive", "read_archive", "save_store", "load_store",
           "ARCHIVE_FORMAT", "ARCHIVE_VERSION", "STORE_KIND", "STORE_VERSION"]

log = logging.getLogger("gpukv")

ARCHIVE_FORMAT = "gpukv-archive"
ARCHIVE_VERSION = 1
STORE_KIND = "gpukv.api.store"
STORE_VERSION = 1

_HEADER_MEMBER = "__gpukv__"
_NAME = re.compile(r"[A-Za-z0-9_.\-/]{1,200}")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


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


@contextlib.contextmanager
def atomic_write(path):
    """Open a binary file that replaces `path` only once it is complete and on disk.

    `with atomic_write(path) as f: f.write(...)` writes a temporary file in the folder of
    `path`; on a clean exit it is flushed, fsynced, renamed over `path` (atomic) and the
    folder is fsynced. On an exception the temporary file is removed and `path` is left
    untouched; a process killed meanwhile leaves `path` untouched and, at worst, a stray
    `.<name>.*.tmp` file beside it.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    name = os.path.basename(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot write a checkpoint there: {exc}") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


# ------------------------------------------------------------------------------- archives
def _restore_dtype(name: str) -> np.dtype:
    """The dtype called `name`, looking in ml_dtypes for the ones NumPy lacks."""
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
        raise CheckpointError(f"unknown dtype {name!r}")
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


def _crc(array: np.ndarray) -> int:
    return zlib.crc32(_contiguous(array).reshape(-1).view(np.uint8)) & 0xFFFFFFFF


def _bad_name(name) -> bool:
    return (not isinstance(name, str) or not _NAME.fullmatch(name) or name == _HEADER_MEMBER
            or any(part in ("", ".", "..") for part in name.split("/")))


def write_archive(path, header: dict, arrays: dict) -> None:
    """Write `arrays` ({name: NumPy array}) and the JSON object `header` to `path`, atomically.

    Names are 1-200 characters of letters, digits and `_ . - /`. The arrays must be NumPy
    arrays (copy GPU arrays to the host first).
    """
    manifest = {}
    prepared = []
    for name, array in arrays.items():
        if _bad_name(name):
            raise CheckpointError(f"array name {name!r}: use 1-200 of [A-Za-z0-9_.-/], "
                                  f"no empty, '.' or '..' parts")
        if not isinstance(array, np.ndarray):
            raise CheckpointError(
                f"array {name!r}: expected a NumPy array, got {type(array).__name__}")
        array = _contiguous(array)
        stored, stored_as = _storable(array)
        manifest[name] = {"dtype": array.dtype.name, "stored_as": stored_as,
                          "shape": list(array.shape), "crc32": _crc(stored)}
        prepared.append((name, stored))
    try:
        text = json.dumps({"format": ARCHIVE_FORMAT, "version": ARCHIVE_VERSION,
                           "header": header, "arrays": manifest},
                          allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{os.fspath(path)}: header is not plain JSON: {exc}") from exc
    header_bytes = np.frombuffer(text.encode("utf-8"), np.uint8)
    with atomic_write(path) as f:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, stored in [(_HEADER_MEMBER, header_bytes)] + prepared:
                with zf.open(name + ".npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, stored, allow_pickle=False)


def read_archive(path) -> tuple[dict, dict]:
    """`(header, arrays)` from an archive written by `write_archive`, checked whole.

    Raises CheckpointError for a missing, truncated, corrupt or foreign file, or one
    written by a newer version of the format.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        npz = np.load(path, allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise CheckpointError(f"{path}: not a gpukv checkpoint (a single .npy array)")
        with npz:
            if _HEADER_MEMBER not in npz.files:
                raise CheckpointError(f"{path}: not a gpukv checkpoint (no {_HEADER_MEMBER})")
            meta = json.loads(npz[_HEADER_MEMBER].tobytes().decode("utf-8"))
            if not isinstance(meta, dict) or meta.get("format") != ARCHIVE_FORMAT:
                found = meta.get("format") if isinstance(meta, dict) else meta
                raise CheckpointError(f"{path}: not a gpukv checkpoint (format {found!r})")
            version = meta.get("version")
            if not isinstance(version, int) or version > ARCHIVE_VERSION or version < 1:
                raise CheckpointError(f"{path}: archive version {version!r} is not supported "
                                      f"(this gpukv reads up to {ARCHIVE_VERSION})")
            header, manifest = meta.get("header"), meta.get("arrays")
            if not isinstance(header, dict) or not isinstance(manifest, dict):
                raise CheckpointError(f"{path}: damaged archive header")
            arrays = {}
            for name, info in manifest.items():
                arrays[name] = _read_member(path, npz, name, info)
    except CheckpointError:
        raise
    except Exception as exc:  # zipfile, numpy.format, json, unicode, OS errors
        raise CheckpointError(f"{path}: unreadable or damaged checkpoint: "
                              f"{type(exc).__name__}: {exc}") from exc
    return header, arrays


def _read_member(path: str, npz, name: str, info) -> np.ndarray:
    if name not in npz.files or not isinstance(info, dict):
        raise CheckpointError(f"{path}: array {name!r} is missing")
    stored = npz[name]
    if stored.dtype.kind not in "biufc":
        raise CheckpointError(f"{path}: array {name!r} has a foreign dtype {stored.dtype}")
    if list(stored.shape) != info.get("shape") or _crc(stored) != info.get("crc32"):
        raise CheckpointError(f"{path}: array {name!r} is damaged (shape or checksum differ)")
    dtype = _restore_dtype(str(info.get("dtype")))
    stored_as = info.get("stored_as")
    if stored_as is None:
        if stored.dtype != dtype:
            raise CheckpointError(f"{path}: array {name!r} is damaged (dtype differs)")
        return stored
    if stored.dtype.name != stored_as or stored.dtype.itemsize != dtype.itemsize:
        raise CheckpointError(f"{path}: array {name!r} is damaged (dtype differs)")
    return stored.view(dtype)


# ------------------------------------------------------------------------ whole stores
# The optimizer state travels through the store's `_export_optimizer_state()` ->
# (header, {name: array}) and `_import_optimizer_state(header, arrays, check_only)`.
def _to_host(entry) -> np.ndarray:
    value = entry.value
    if isinstance(value, np.ndarray):
        return value
    home = entry.home
    with home.cuda_device:
        return value.get(stream=home.stream)


def save_store(kv, path) -> None:
    """Write every key of `kv` (and its optimizer state) to `path`; see `KVStore.save`."""
    with kv._lock:
        keys = list(kv._entries)
        kind = kv._key_kind.__name__ if kv._key_kind is not None else None
        arrays, homes = {}, []
        for i, key in enumerate(keys):
            entry = kv._entries[key]
            arrays[f"value/{i}"] = _to_host(entry)
            homes.append(entry.home.kind)
        optimizer = None
        if kv._optimizer is not None:
            exported = kv._export_optimizer_state()
            if exported is not None:
                opt_header, opt_arrays = exported
                optimizer = {"header": opt_header, "arrays": []}
                for name, array in opt_arrays.items():
                    arrays[f"optimizer/{name}"] = array
                    optimizer["arrays"].append(name)
        header = {"kind": STORE_KIND, "version": STORE_VERSION, "store_type": kv.type,
                  "key_kind": kind, "keys": [str(k) for k in keys], "homes": homes,
                  "optimizer": optimizer}
        write_archive(path, header, arrays)


def _parse_store(path: str, header: dict, arrays: dict):
    """(keys, kind, homes, values, optimizer) from a store archive, or CheckpointError."""
    if header.get("kind") != STORE_KIND:
        raise CheckpointError(f"{path}: a {header.get('kind')!r} archive, not a store checkpoint")
    version = header.get("version")
    if not isinstance(version, int) or not 1 <= version <= STORE_VERSION:
        raise CheckpointError(f"{path}: store checkpoint version {version!r} is not supported "
                              f"(this gpukv reads up to {STORE_VERSION})")
    kind_name, raw_keys, homes = header.get("key_kind"), header.get("keys"), header.get("homes")
    if (kind_name not in ("int", "str", None) or not isinstance(raw_keys, list)
            or not isinstance(homes, list) or len(homes) != len(raw_keys)
            or not all(isinstance(k, str) for k in raw_keys)
            or (kind_name is None and raw_keys)):
        raise CheckpointError(f"{path}: damaged store header")
    kind = {"int": int, "str": str, None: None}[kind_name]
    try:
        keys = [int(k) for k in raw_keys] if kind is int else list(raw_keys)
    except ValueError as exc:
        raise CheckpointError(f"{path}: damaged store header (int keys): {exc}") from exc
    if len(set(keys)) != len(keys):
        raise CheckpointError(f"{path}: damaged store header (a key appears twice)")
    from ..device import SUPPORTED_DTYPES
    values = []
    for i, key in enumerate(keys):
        value = arrays.get(f"value/{i}")
        if value is None:
            raise CheckpointError(f"{path}: the value of key {key!r} is missing")
        if value.dtype.name not in SUPPORTED_DTYPES:
            raise CheckpointError(f"{path}: key {key!r} has unsupported dtype {value.dtype}")
        values.append(value)
    optimizer = header.get("optimizer")
    if optimizer is not None:
        if not isinstance(optimizer, dict) or not isinstance(optimizer.get("arrays"), list):
            raise CheckpointError(f"{path}: damaged optimizer section")
        try:
            opt_arrays = {name: arrays[f"optimizer/{name}"] for name in optimizer["arrays"]}
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"{path}: optimizer array {exc} is missing") from exc
        optimizer = (optimizer.get("header"), opt_arrays)
    return keys, kind, homes, values, optimizer


def load_store(kv, path) -> None:
    """Read `path` into `kv`; see `KVStore.load` for the semantics."""
    path = os.fspath(path)
    header, arrays = read_archive(path)
    keys, kind, homes, values, optimizer = _parse_store(path, header, arrays)
    from .store import _Entry
    with kv._lock:
        # Check everything first: a failed load changes nothing.
        if kind is not None and kv._key_kind is not None and kind is not kv._key_kind:
            raise CheckpointError(f"{path}: holds {kind.__name__} keys but this store holds "
                                  f"{kv._key_kind.__name__} keys")
        for key, value in zip(keys, values):
            entry = kv._entries.get(key)
            if entry is not None and (entry.value.shape != value.shape
                                      or entry.value.dtype != value.dtype):
                raise CheckpointError(
                    f"{path}: key {key!r} is {value.dtype}{list(value.shape)} in the file but "
                    f"{entry.value.dtype}{list(entry.value.shape)} in the store")
        load = dict(kv._load)
        planned = {}  # new key -> (value from the file, its home device)
        for key, value, home_kind in zip(keys, values, homes):
            if key not in kv._entries:
                home = _new_home(kv, home_kind, load)
                load[home] = load.get(home, 0) + value.nbytes
                planned[key] = (value, home)
        restore_optimizer = optimizer is not None and kv._optimizer is not None
        if restore_optimizer:
            _check_optimizer_state(kv, path, optimizer, planned)
        elif optimizer is not None:
            log.info("gpukv: %s holds optimizer state but the store has no optimizer; "
                     "only values were loaded", path)
        # Apply.
        touched = set()
        for key, value in zip(keys, values):
            entry = kv._entries.get(key)
            if entry is None:
                home = planned[key][1]
                stored = home.empty(value.shape, value.dtype)
                home.copy(stored, value)
                entry = kv._entries[key] = _Entry(stored, home)
            else:
                entry.home.copy(entry.value, value)
            if entry.home.kind == "gpu":
                touched.add(entry.home)
        for home in touched:  # the host arrays from the file go away after this call
            home.synchronize()
        kv._load = load
        if kind is not None:
            kv._key_kind = kind
        if restore_optimizer:
            kv._import_optimizer_state(optimizer[0], optimizer[1], check_only=False)


def _new_home(kv, home_kind: str, load: dict):
    """The home of a key the load creates: GPU-homed keys back on the least-loaded GPU
    when the store reduces on GPUs and has some, every other key on the host."""
    from ..device import host_device
    if home_kind == "gpu" and kv._on_gpu:
        from ..device.cuda.device import gpu_count, gpu_devices
        gpus = gpu_devices() if gpu_count() else []
        if gpus:
            return min(gpus, key=lambda d: load.get(d, 0))
    return host_device(0)


def _check_optimizer_state(kv, path: str, optimizer, planned: dict) -> None:
    """Validate the file's optimizer state against the store as it will be after the load."""
    header, arrays = optimizer
    updater = kv._updater
    try:
        if hasattr(updater, "import_state"):
            entries = kv._entry_map()
            entries.update(planned)  # keys the load creates are checked too
            updater.import_state(header, arrays, entries, check_only=True, path=path)
        else:
            kv._import_optimizer_state(header, arrays, check_only=True)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{path}: optimizer state does not fit this store's "
                              f"optimizer: {type(exc).__name__}: {exc}") from exc
