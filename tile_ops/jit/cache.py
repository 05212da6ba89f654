"""On-disk kernel cache: one directory per key with the CUDA source, the cubin and metadata.

Layout: ``<root>/<key[:2]>/<key>/{kernel.cu, kernel.cubin, meta.json}``.  ``meta.json``
records the sha256 and size of the two other files, its key, and a sha256 of its kernel
description (grid, shared memory, parameters: what a launch uses as stored) with the key, so
a truncated, corrupted, edited or misplaced entry is detected on load, removed (with a
warning) and rebuilt by the caller.  Stores are
atomic (temp directory + ``os.rename``; the first writer wins) and :meth:`DiskCache.lock`
lets concurrent processes compile a key once; a process waiting for a key's lock names the holder (its pid, recorded
in the lock file) after a few seconds and gives up after ``$TILE_OPS_LOCK_TIMEOUT`` seconds (default 600).

This module must not import TVM (nor torch): a process with a warm cache only reads files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import pathlib
import re
import secrets
import shutil
import socket
import time
import warnings
from typing import Iterator

__all__ = ["CacheEntry", "DiskCache", "LockTimeout", "cache_dir", "lock_timeout", "not_stored"]

SOURCE_FILE = "kernel.cu"
CUBIN_FILE = "kernel.cubin"
META_FILE = "meta.json"
_ENTRY_FILES = {SOURCE_FILE, CUBIN_FILE, META_FILE}
_HEX = re.compile(r"[0-9a-f]+")  # keys and their shards
_TEMP = re.compile(r"[0-9a-f]+\.[A-Za-z0-9_]{8}")  # a store's temp dir: <key>.<8 random characters>
_STALE_TMP_S = 3600  # a store's temp dir lives for seconds; one an hour old was left by a killed process
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)  # another user's file, a read-only mount
LOCK_TIMEOUT_S = 600.0  # the default of $TILE_OPS_LOCK_TIMEOUT: a kernel compiles in seconds to a minute
_LOCK_REPORT_S = 5.0  # a wait this long is worth a warning naming the holder (a compile's lock is held for seconds)
_LOCK_POLL_S = (0.002, 0.1)  # the first and the longest sleep between two attempts to take a lock

not_stored: dict[str, str] = {}  # key -> why this process could not store its kernel: `precompile` and `tune` report it


class CacheDirError(NotADirectoryError):
    """The cache path names something other than a directory."""


class LockTimeout(TimeoutError):
    """Another process held a key's lock for longer than ``$TILE_OPS_LOCK_TIMEOUT`` seconds."""


def lock_timeout() -> float:
    """``$TILE_OPS_LOCK_TIMEOUT`` (seconds, read at each call; ``inf`` waits forever), else :data:`LOCK_TIMEOUT_S`."""
    text = os.environ.get("TILE_OPS_LOCK_TIMEOUT", "").strip()
    if not text:
        return LOCK_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:  # nan too
        raise ValueError(f"tile_ops: TILE_OPS_LOCK_TIMEOUT={text!r} is not a time to wait for a kernel's cache lock; "
                         f"accepted: a positive number of seconds (default {LOCK_TIMEOUT_S:g}), or inf to wait "
                         f"forever")
    return seconds


def cache_dir() -> pathlib.Path:
    """``$TILE_OPS_CACHE_DIR`` if set (read at each call), else ``~/.tile_ops/cache``."""
    env = os.environ.get("TILE_OPS_CACHE_DIR")
    root = pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".tile_ops" / "cache"
    # the path itself or the ancestor it would be made in: a file, or a link to nothing (an unmounted volume), read
    # as an empty cache while every build failed on <root>/locks
    there = next(p for p in (root, *root.parents) if p.exists() or p.is_symlink())
    if not there.is_dir():
        what = (f"a symbolic link to {os.readlink(there)}, which does not exist" if there.is_symlink()
                and not there.exists() else "not a directory")
        where = "" if there == root else f"cannot be made: {there} "
        raise CacheDirError(f"tile_ops: the kernel cache {root} ({'TILE_OPS_CACHE_DIR' if env else 'the default'}) "
                            f"{where}is {what}; accepted: a directory, or a path that does not exist yet")
    return root


@dataclasses.dataclass
class CacheEntry:
    source: str
    cubin: bytes
    meta: dict = dataclasses.field(default_factory=dict)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def description_sha256(key: str, description) -> str:
    """The checksum of an entry's kernel description, bound to its key (an entry copied under another key fails)."""
    return _sha256(json.dumps({"key": key, "meta": description}, sort_keys=True).encode())


def write_synced(path: pathlib.Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: pathlib.Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Corrupt(Exception):
    pass


def _make_temp_dir(parent: pathlib.Path, prefix: str) -> pathlib.Path:
    """A new directory ``<prefix><8 random characters>`` with the mode the umask gives any directory (mkdtemp's is
    0700: users sharing the cache could not read the entry it becomes)."""
    while True:
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        with contextlib.suppress(FileExistsError):
            path.mkdir()
            return path


def _open_lock(path: pathlib.Path) -> int | None:
    """A descriptor of the lock file ``path`` to flock: read-write, created with the umask's mode (readable by the
    other users of a shared cache); read-only where it exists and is not ours to write (flock needs no write
    access); None where it cannot be made (a read-only cache)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        if e.errno not in _NOT_WRITABLE:
            raise
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as e:
        if e.errno not in _NOT_WRITABLE + (errno.ENOENT,):
            raise
        return None


def _record_holder(fd: int, holder: dict | None) -> None:
    """Write ``holder`` (this process: pid, host, since when) into the lock file, or empty it (``None``) on release,
    so that a waiting process can name whom it waits for.  Best effort: another user's lock file is read-only."""
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
        return
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        if holder is not None:
            os.pwrite(fd, json.dumps(holder).encode(), 0)


def _holder(fd: int) -> str:
    """Who holds the lock of ``fd``, in words: the pid its holder recorded and that process's state here."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0))
        pid, host, since = int(holder["pid"]), str(holder["host"]), float(holder["since"])
    except (OSError, ValueError, TypeError, KeyError):  # not recorded (another user's lock file), or being rewritten
        return "another process (its pid is not recorded in the lock file)"
    held = f"it has held the lock {max(0.0, time.time() - since):.0f} s"
    if host != socket.gethostname():  # a cache shared over the network: that pid is not one of ours
        return f"pid {pid} on host {host} ({held})"
    return f"pid {pid} ({_process_state(pid)}; {held})"


def _process_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0].decode()  # the field after the command's (name)
    except FileNotFoundError:  # the lock outlived it: a child it forked holds it, or a holder that could not record
        return "no longer running; a process it started holds the lock, or another user's process"
    except (OSError, IndexError, UnicodeDecodeError):
        return "state unknown"
    return {"T": f"STOPPED: kill -CONT {pid} resumes it", "t": "stopped by a debugger"}.get(state, "running")


class DiskCache:
    """Kernel cache rooted at ``root`` (default: :func:`cache_dir` at construction time)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = pathlib.Path(root) if root is not None else cache_dir()

    def path(self, key: str) -> pathlib.Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"tile_ops: invalid cache key {key!r}")
        return self.root / key[:2] / key

    # -- read ----------------------------------------------------------------------------
    def load(self, key: str) -> CacheEntry | None:
        path = self.path(key)
        try:
            return self._read(path) if path.exists() else None
        except PermissionError:  # another user's entry we may not read: a miss, not damage to remove
            return None
        except (_Corrupt, OSError, ValueError, KeyError, TypeError) as e:
            self.discard(key, e)
            return None

    def discard(self, key: str, why) -> None:
        """Remove a corrupt entry (its files, or its kernel description), warning why: the caller rebuilds it."""
        path = self.path(key)
        warnings.warn(f"tile_ops: cache entry {key} at {path} is corrupt ({why}); rebuilding it")
        shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def _read(path: pathlib.Path) -> CacheEntry:
        try:
            meta = json.loads((path / META_FILE).read_text())
        except FileNotFoundError:
            raise _Corrupt(f"{META_FILE} is missing") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise _Corrupt(f"{META_FILE} is not valid JSON: {e}") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
            raise _Corrupt(f"{META_FILE} has no 'files' record")
        if meta.get("key") != path.name:
            raise _Corrupt(f"it is the entry of key {meta.get('key')!r}, not of {path.name}")
        if meta.get("description_sha256") != description_sha256(path.name, meta.get("meta")):
            raise _Corrupt("its kernel description (grid, shared memory, parameters) does not match its checksum")
        data = {}
        for name in (SOURCE_FILE, CUBIN_FILE):
            rec = meta["files"].get(name)
            if not isinstance(rec, dict):
                raise _Corrupt(f"{META_FILE} has no record for {name}")
            try:
                blob = (path / name).read_bytes()
            except FileNotFoundError:
                raise _Corrupt(f"{name} is missing") from None
            if len(blob) != rec.get("size"):
                raise _Corrupt(f"{name} has {len(blob)} bytes, expected {rec.get('size')}")
            if _sha256(blob) != rec.get("sha256"):
                raise _Corrupt(f"{name} sha256 mismatch")
            data[name] = blob
        return CacheEntry(source=data[SOURCE_FILE].decode("utf-8"), cubin=data[CUBIN_FILE],
                          meta=meta.get("meta", {}))

    # -- write ---------------------------------------------------------------------------
    def store(self, key: str, entry: CacheEntry) -> str | None:
        """Atomically publish ``entry``; if another process already published ``key``, keep theirs.  Returns None
        once the key's entry is in the cache, else why not (also warned and kept in :data:`not_stored`): a store
        that fails (a full disk, a read-only cache) leaves the caller its kernel either way."""
        try:
            self._publish(key, entry)
        except (OSError, _Corrupt) as e:
            not_stored[key] = str(e)
            warnings.warn(f"tile_ops: could not store kernel {key} in the cache at {self.root}: {e}")
            return str(e)
        not_stored.pop(key, None)
        return None

    def _publish(self, key: str, entry: CacheEntry) -> None:
        final = self.path(key)
        if final.exists():
            try:  # another process's entry; or one that does not load here and load() could not (or must not) remove
                self._read(final)
            except (_Corrupt, OSError, ValueError, KeyError, TypeError) as e:
                raise _Corrupt(f"the entry already at {final} does not load ({e}); remove it (it may be another "
                               f"user's)") from None
            return
        tmp_root = self.root / "tmp"
        tmp_root.mkdir(parents=True, exist_ok=True)
        tmp = _make_temp_dir(tmp_root, f"{key}.")
        try:
            blobs = {SOURCE_FILE: entry.source.encode("utf-8"), CUBIN_FILE: bytes(entry.cubin)}
            for name, blob in blobs.items():
                write_synced(tmp / name, blob)
            meta = {
                "key": key,
                "files": {n: {"sha256": _sha256(b), "size": len(b)} for n, b in blobs.items()},
                "meta": entry.meta,
                "description_sha256": description_sha256(key, entry.meta),
            }
            write_synced(tmp / META_FILE, json.dumps(meta, indent=1, sort_keys=True).encode())
            fsync_dir(tmp)
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.exists():  # not a lost race: a real error
                    raise
            else:
                fsync_dir(final.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float | None = None) -> Iterator[None]:
        """Exclusive inter-process lock for ``key`` (fcntl.flock on ``<root>/locks/<key>.lock``, which records the
        holder's pid).  A wait warns whom it waits for after a few seconds and raises :class:`LockTimeout` after
        ``timeout`` seconds (default: :func:`lock_timeout`).  Where the lock file cannot be made (a read-only
        cache) it does not lock: the store that follows fails too and says so, and the caller keeps the kernel
        it built."""
        self.path(key)  # validate the key
        timeout = lock_timeout() if timeout is None else timeout
        path = self.root / "locks" / f"{key}.lock"
        fd = _open_lock(path)
        if fd is None:
            yield
            return
        try:
            self._wait_for_lock(fd, key, path, timeout)
            _record_holder(fd, {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
            try:
                yield
            finally:
                _record_holder(fd, None)  # while held: a record outliving the lock would name a wrong holder
        finally:
            os.close(fd)  # releases the lock

    @staticmethod
    def _wait_for_lock(fd: int, key: str, path: pathlib.Path, timeout: float) -> None:
        """Take the flock of ``fd`` with non-blocking attempts (a blocking flock waits, silently, for ever on a
        stopped or hung holder)."""
        start, delay, reported = time.monotonic(), _LOCK_POLL_S[0], False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            waited = time.monotonic() - start
            if waited >= timeout:
                raise LockTimeout(
                    f"tile_ops: gave up waiting for the lock of cache key {key} after {waited:.0f} s: {path} is held "
                    f"by {_holder(fd)}, which is still compiling that kernel or is hung.  If it is hung or stopped, "
                    f"end it (its lock goes with it) and run again; or set TILE_OPS_LOCK_TIMEOUT=SECONDS to wait "
                    f"longer (now {timeout:g}; inf waits forever)")
            if not reported and waited >= _LOCK_REPORT_S:
                reported = True
                warnings.warn(f"tile_ops: waiting for the lock of cache key {key}: {path} is held by {_holder(fd)}; "
                              f"giving up after {timeout:g} s (TILE_OPS_LOCK_TIMEOUT)", stacklevel=4)
            time.sleep(min(delay, max(0.0, timeout - waited)))
            delay = min(2 * delay, _LOCK_POLL_S[1])

    # -- maintenance ---------------------------------------------------------------------
    def _entries(self) -> list[pathlib.Path]:
        """The entry directories: ``<root>/<key[:2]>/<key>/`` holding an entry's file (and maybe others: such a
        directory is the key's, which load() serves, and discard() removes whole).  Anything else under the root
        (a mistaken TILE_OPS_CACHE_DIR=$HOME) is not ours to count or delete."""
        if not self.root.is_dir():
            return []
        return [e for shard in self.root.iterdir() if shard.is_dir() and _HEX.fullmatch(shard.name)
                and len(shard.name) == 2 for e in shard.iterdir()
                if e.is_dir() and _HEX.fullmatch(e.name) and e.name.startswith(shard.name) and _holds_entry_files(e)]

    def info(self) -> dict:
        entries = self._entries()
        size = 0
        for e in entries:
            with contextlib.suppress(OSError):  # an entry may vanish while we look
                size += sum(f.stat().st_size for f in e.iterdir() if f.is_file())
        return {"path": str(self.root), "entries": len(entries), "bytes": size}

    def clear(self) -> tuple[int, list[str]]:
        """Remove every entry (its directory, with any file put in it: load() would serve the entry beside it) and
        the temp dirs stores left behind (not those of stores in progress); returns the number of entries removed
        and those left, each with why (a read-only cache, another user's entries)."""
        removed, left = 0, []
        for e in self._entries():
            try:
                shutil.rmtree(e)
                removed += 1
            except FileNotFoundError:  # removed meanwhile by another process
                pass
            except OSError as err:
                left.append(f"{e} ({err.strerror or err})")
        tmp_root, now = self.root / "tmp", time.time()
        for tmp in tmp_root.iterdir() if tmp_root.is_dir() else ():
            with contextlib.suppress(OSError):  # only what _publish names: <key>.<8 characters>, left an hour ago
                if _TEMP.fullmatch(tmp.name) and tmp.is_dir() and now - tmp.stat().st_mtime > _STALE_TMP_S:
                    shutil.rmtree(tmp, ignore_errors=True)
        return removed, left


def _holds_entry_files(path: pathlib.Path) -> bool:
    with contextlib.suppress(OSError):
        return any(f.name in _ENTRY_FILES for f in path.iterdir())
    return False
