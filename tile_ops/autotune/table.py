"""The tuned-config table: ``<cache_dir()>/autotune.json``, and the lookup the ops use.

File format (JSON)::

    {"version": 1,
     "entries": {"NVIDIA H200|gemm|float16|4096x4096x4096|sm_90a": {
         "gpu": "NVIDIA H200", "op": "gemm", "dtype": "float16", "shape": [4096, 4096, 4096],
         "config": {"block_M": 128, ...},            # dataclasses.asdict of the kernel's config
         "ms": 0.21, "default_ms": 0.25,             # best and heuristic-default times (median)
         "arch": "sm_90a", "candidates": 56, "skipped": 3, "tuned_at": "2026-...Z", "compiler": "..."}}}

Writers take ``DiskCache.lock("autotune")``, re-read the file, merge their entries and publish
with write-temp + ``os.replace``, so concurrent tuning processes never lose each other's keys and
readers (which take no lock) always see a whole file.  Keys written before they had the arch
(``gpu|op|dtype|MxNxK``) still read: lookups go by the entries' fields.

Shape buckets: a tuned shape is stored and found under its exact M x N x K.  An untuned shape uses
the entry with the same N and K whose M is in the same bucket, the smallest power of two >= M
(513..1024 -> 1024), nearest M first: N and K are the model's weight dims and stay fixed while M
(tokens x batch) varies.  Otherwise the kernel's heuristic ``default_config``.

Nothing here imports torch at module level, nor TVM.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import os
import pathlib
import sys
import tempfile
import warnings

from ..jit.cache import DiskCache, fsync_dir, write_synced, cache_dir
from . import targets

TABLE_FILE = "autotune.json"
VERSION = 1
_LOCK_KEY = "autotune"


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(op: str, d: dict):
    """The op's config from its JSON dict; fields added since it was written take their defaults, a
    field that no longer exists makes it stale (ValueError)."""
    cls = targets.get(op).config_class()
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    return cls(**d)


def shape_bucket(M: int) -> int:
    """The M bucket of an untuned shape: the smallest power of two >= M."""
    return 1 << max(0, int(M) - 1).bit_length()


def entry_key(gpu: str, op: str, dtype: str, shape, arch: str | None = None) -> str:
    """The entry's key: one per compile target too (sm_90 and sm_90a runs on one GPU are both kept)."""
    M, N, K = shape
    return f"{gpu}|{op}|{dtype}|{M}x{N}x{K}" + (f"|{arch}" if arch else "")


def entry_problem(e) -> str | None:
    """Why ``e`` is not a well-formed table entry (a hand edit, another tool's merge), or None."""
    if not isinstance(e, dict):
        return "not an object"
    shape = e.get("shape")
    if not (isinstance(shape, list) and len(shape) == 3 and all(type(x) is int and x > 0 for x in shape)):
        return f"shape {shape!r} is not three positive integers"
    if not isinstance(e.get("config"), dict):
        return f"config {e.get('config')!r} is not an object"
    for name in ("gpu", "op", "dtype"):
        if not isinstance(e.get(name), str):
            return f"{name} {e.get(name)!r} is not a string"
    for name in ("arch", "tuned_at", "compiler"):
        if not isinstance(e.get(name, ""), (str, type(None))):
            return f"{name} {e.get(name)!r} is not a string"
    for name in ("ms", "default_ms"):
        if e.get(name) is not None and not (type(e[name]) in (int, float) and e[name] > 0):
            return f"{name} {e[name]!r} is not a positive number"
    return None


class TableWriteError(OSError):
    """The tuned table could not be written (a read-only or full cache, an I/O error)."""


def table_path() -> pathlib.Path:
    return cache_dir() / TABLE_FILE


class TuneTable:
    """The table file at ``path`` (default: :func:`table_path` at construction time)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = pathlib.Path(path) if path is not None else table_path()

    def entries(self) -> dict:
        """key -> entry, the well-formed ones; a missing file is empty, an unreadable one is empty with a warning,
        as are malformed entries (one warning for all)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            warnings.warn(f"tile_ops: ignoring the autotune table {self.path}: {e}")
            return {}
        entries, malformed = {}, []
        for key, e in self._ours(data).items():
            problem = entry_problem(e)
            if problem:
                malformed.append(f"{key!r} ({problem})")
            else:
                entries[key] = e
        if malformed:
            warnings.warn(f"tile_ops: ignoring {len(malformed)} malformed entr{'y' if len(malformed) == 1 else 'ies'} "
                          f"of the autotune table {self.path}: {', '.join(malformed)}")
        return entries

    def _ours(self, data) -> dict:
        """The entries of a parsed table of our version; {} with a warning for anything else."""
        if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("entries"), dict):
            warnings.warn(f"tile_ops: ignoring the autotune table {self.path}: not a version {VERSION} table")
            return {}
        return data["entries"]

    def update(self, put: dict | None = None, remove=()) -> None:
        """Merge ``put`` (key -> entry) and drop the keys in ``remove``, atomically."""

        def change(entries):
            entries.update(put or {})
            for key in remove:
                entries.pop(key, None)

        self._modify(change)

    def clear(self) -> int:
        """Remove every entry; returns how many there were."""
        removed = []

        def change(entries):
            removed.extend(entries)
            entries.clear()

        self._modify(change, overwrite=True)
        return len(removed)

    def _modify(self, change, overwrite: bool = False) -> None:
        """Read, ``change(entries)`` in place, publish: under the lock, so concurrent writers merge.  A table
        of another version (another tile_ops sharing the cache) is left alone unless ``overwrite``; one whose
        content is not a table is kept beside the new one as ``autotune.json.unreadable[.N]``.  An I/O error
        raises :class:`TableWriteError`, the table untouched."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with DiskCache(self.path.parent).lock(_LOCK_KEY):
                entries = self._entries_to_change(overwrite)
                change(entries)
                self._publish({"version": VERSION, "entries": dict(sorted(entries.items()))})
        except OSError as e:
            raise TableWriteError(f"tile_ops: could not write the autotune table {self.path}: {e} (it is "
                                  f"unchanged; TILE_OPS_CACHE_DIR selects another cache directory)") from e
        reload()

    def _entries_to_change(self, overwrite: bool) -> dict:
        """The entries a writer starts from, read once (under the lock).  Only unreadable content is set aside: an
        I/O error (EMFILE, EIO) says nothing about the table, and raises."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except ValueError as e:  # not JSON, or not UTF-8
            return self._set_aside(e)
        if not isinstance(data, dict) or (data.get("version") == VERSION and not isinstance(data.get("entries"), dict)):
            return self._set_aside(f"not a version {VERSION} table")
        version = data.get("version")
        if version != VERSION and not overwrite:
            raise RuntimeError(f"tile_ops: the autotune table {self.path} is version {version!r}, not {VERSION} "
                               f"(another tile_ops shares this cache directory?); not writing over it. Use another "
                               f"TILE_OPS_CACHE_DIR, or `python -m tile_ops tune --clear` to start a version "
                               f"{VERSION} table there")
        return self._ours(data)

    def _set_aside(self, problem) -> dict:
        """Move the table to the first free ``autotune.json.unreadable[.N]`` (earlier ones kept); {}: start empty."""
        aside = next(p for n in itertools.count() if not (p := self.path.with_name(
            f"{self.path.name}.unreadable" + (f".{n}" if n else ""))).exists())
        warnings.warn(f"tile_ops: ignoring the autotune table {self.path} ({problem}); kept as {aside.name}")
        os.replace(self.path, aside)
        return {}

    def _publish(self, data: dict) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f"{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        os.close(fd)
        try:
            write_synced(pathlib.Path(tmp), json.dumps(data, indent=1).encode())  # configs keep field order
            os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; the cache directory may be shared
            os.replace(tmp, self.path)
            fsync_dir(self.path.parent)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def record(op: str, shape, dtype: str, gpu: str, cfg, **stats) -> str:
    """Store ``cfg`` as the best config of (gpu, op, shape, dtype) for ``stats["arch"]``; returns the entry's key."""
    from ..jit import compiler_fingerprint

    arch = stats.get("arch")
    key, old_key = entry_key(gpu, op, dtype, shape, arch), entry_key(gpu, op, dtype, shape)
    entry = {"gpu": gpu, "op": op, "dtype": dtype, "shape": [int(x) for x in shape],
             "config": config_to_dict(cfg), "compiler": compiler_fingerprint(),
             "tuned_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), **stats}

    def change(entries):
        old = entries.get(old_key)  # a key from before keys had the arch: this entry supersedes it if for this arch
        if isinstance(old, dict) and old.get("arch") in (None, arch):
            del entries[old_key]
        entries[key] = entry

    TuneTable()._modify(change)
    return key


# ---------------------------------------------------------------------------------------- lookup
_index: dict | None = None  # (gpu, op, dtype, N, K) -> [(M, config, arch)], built from the table once
_chosen: dict = {}  # (op, M, N, K, dtype, device) -> config: the op's per-call path is one dict hit
_gpu_names: dict = {}


def reload() -> None:
    """Forget what was read from the table (after it changed, or TILE_OPS_CACHE_DIR did), and the ops'
    recorded plans, which launch the configs chosen before."""
    global _index
    _index = None
    _chosen.clear()
    fastpath = sys.modules.get("tile_ops.ops.fastpath")  # loaded only where an op ran: nothing to forget else
    if fastpath is not None:
        fastpath.clear()


def _load_index() -> dict:
    index: dict = {}
    for key, e in TuneTable().entries().items():  # well-formed: shape three ints, the names strings
        try:
            M, N, K = e["shape"]
            cfg = config_from_dict(e["op"], e["config"])
            index.setdefault((e["gpu"], e["op"], e["dtype"], N, K), []).append((M, cfg, e.get("arch")))
        except (KeyError, TypeError, ValueError) as err:
            warnings.warn(f"tile_ops: ignoring autotune entry {key!r}: {err}")
    return index


def lookup(op: str, shape, dtype: str, gpu: str | None, arch: str | None = None):
    """The tuned config for (gpu, op, shape, dtype) under the bucket rule, or None; with ``arch``, only one
    tuned for that compile target (an sm_90a config may need clusters or TMA that sm_80 lacks)."""
    global _index
    if gpu is None:
        return None
    if _index is None:
        _index = _load_index()
    M, N, K = shape
    tuned = _index.get((gpu, op, dtype, N, K), [])
    same_bucket = [(abs(m - M), -m, cfg) for m, cfg, tuned_for in tuned
                   if shape_bucket(m) == shape_bucket(M) and (arch is None or tuned_for in (None, arch))]
    return min(same_bucket, key=lambda t: t[:2])[2] if same_bucket else None


def gpu_name(device=None) -> str | None:
    """The name of ``device``'s GPU (default: the current one), or None off CUDA."""
    import torch

    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return None
    index = torch.device(device).index if device is not None else None
    index = torch.cuda.current_device() if index is None else index
    if index not in _gpu_names:
        _gpu_names[index] = torch.cuda.get_device_name(index)
    return _gpu_names[index]


def config_for(op: str, M: int, N: int, K: int, dtype: str, device=None, arch: str | None = None):
    """THE config an op launches with: the tuned one for this GPU and shape, else the kernel's
    ``default_config(M, N, K, arch)`` (``arch``: the compile target, by default the local GPU's).
    Memoized per (op, shape, dtype, device, arch)."""
    memo = (op, M, N, K, dtype, device, arch)
    cfg = _chosen.get(memo)
    if cfg is None:
        from ..jit import default_arch  # what the op compiles for: the current device's arch

        cfg = (lookup(op, (M, N, K), dtype, gpu_name(device), arch or default_arch())
               or targets.get(op).default_config((M, N, K), arch))
        _chosen[memo] = cfg
    return cfg
