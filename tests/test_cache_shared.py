"""A kernel cache this process may not write: another user's (a team-shared TILE_OPS_CACHE_DIR) or a read-only
mount (a cache precompiled into an image).  Kernels still build, entries are shared, nothing claims to be removed
or stored when it was not.

The tests run as root in CI, which passes permission bits: ``deny`` patches the os calls instead, failing writes
(and, with ``reads=True``, reads) under a path as the kernel would."""

import builtins
import errno
import fcntl
import io
import os
import stat
import warnings

import pytest

from tile_ops.jit import cache as cache_mod
from tile_ops.jit.cache import CacheEntry, DiskCache

KEY = "ab" + "0123456789abcdef" * 3
OTHER_KEY = "cd" + "0123456789abcdef" * 3
ENTRY = CacheEntry(source="// src\n", cubin=b"cubin" * 100, meta={"kernel": "k"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@pytest.fixture
def deny(monkeypatch):
    """``deny(path, err=errno.EROFS, reads=False)``: opening for writing, creating, renaming, removing or chmod-ing
    anything under ``path`` fails with ``err`` (with ``reads``, opening for reading too)."""
    rules = []

    def resolve(path, dir_fd=None):
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        return os.path.abspath(path)

    def check(path, dir_fd=None, writing=True):
        if isinstance(path, int):
            return
        full = resolve(path, dir_fd)
        for root, err, reads in rules:
            if (writing or reads) and (full == root or full.startswith(root + os.sep)):
                raise OSError(err, os.strerror(err), full)

    real = {name: getattr(os, name) for name in ("open", "mkdir", "rmdir", "unlink", "remove", "rename", "replace",
                                                  "chmod")}

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        check(path, dir_fd, writing=bool(flags & _WRITE_FLAGS))
        return real["open"](path, flags, mode, dir_fd=dir_fd)

    def mkdir(path, mode=0o777, *, dir_fd=None):
        if os.path.lexists(resolve(path, dir_fd)):  # as the kernel: EEXIST before EROFS
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(path))
        check(path, dir_fd)
        return real["mkdir"](path, mode, dir_fd=dir_fd)

    def one_path(name):
        def call(path, *args, dir_fd=None, **kw):
            check(path, dir_fd)
            return real[name](path, *args, dir_fd=dir_fd, **kw)
        return call

    def two_paths(name):
        def call(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
            check(src, src_dir_fd)
            check(dst, dst_dir_fd)
            return real[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        return call

    def file_open(real_open):
        def call(file, mode="r", *args, **kw):
            if isinstance(file, (str, bytes, os.PathLike)):
                check(file, writing=any(c in mode for c in "wax+"))
            return real_open(file, mode, *args, **kw)
        return call

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "mkdir", mkdir)
    for name in ("rmdir", "unlink", "remove", "chmod"):
        monkeypatch.setattr(os, name, one_path(name))
    for name in ("rename", "replace"):
        monkeypatch.setattr(os, name, two_paths(name))
    monkeypatch.setattr(builtins, "open", file_open(builtins.open))
    monkeypatch.setattr(io, "open", file_open(io.open))  # pathlib's
    return lambda path, err=errno.EROFS, reads=False: rules.append((os.path.abspath(path), err, reads))


@pytest.fixture
def dc(tmp_path):
    return DiskCache(tmp_path / "cache")


def test_entries_and_lock_files_are_readable_by_other_users(dc):
    """mkdtemp made every entry 0700: another user read it as corrupt and could not share it."""
    old_umask = os.umask(0o022)
    try:
        dc.store(KEY, ENTRY)
        with dc.lock(KEY):
            pass
    finally:
        os.umask(old_umask)
    entry = dc.path(KEY)
    assert stat.S_IMODE(entry.stat().st_mode) == 0o755
    assert {stat.S_IMODE(f.stat().st_mode) for f in entry.iterdir()} == {0o644}
    assert stat.S_IMODE((dc.root / "locks" / f"{KEY}.lock").stat().st_mode) == 0o644


def test_another_users_lock_file_is_locked_read_only(dc, deny):
    with dc.lock(KEY):  # another user made it
        pass
    lock_file = dc.root / "locks" / f"{KEY}.lock"
    deny(lock_file, errno.EACCES)
    with dc.lock(KEY):
        with open(lock_file, "rb") as other:  # another open file description: another process's view
            with pytest.raises(BlockingIOError):
                fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock_file, "rb") as other:  # released
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_an_entry_this_user_cannot_read_is_a_miss_not_corrupt(dc, deny):
    dc.store(KEY, ENTRY)
    deny(dc.path(KEY), errno.EACCES, reads=True)  # another user's, private
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not "corrupt ... rebuilding it"
        assert dc.load(KEY) is None
    assert dc.path(KEY).is_dir()  # not discarded
    with pytest.warns(UserWarning, match=rf"could not store kernel {KEY} .*the entry already at .*{KEY} does not "
                                         r"load \(.*Permission denied.*\); remove it"):
        assert "does not load" in dc.store(KEY, ENTRY)
    assert "Permission denied" in cache_mod.not_stored[KEY]


def test_a_corrupt_entry_that_cannot_be_removed_is_reported_by_store(dc, deny):
    """discard() failed silently and _publish() saw the path and returned: every run rebuilt and stored nothing."""
    dc.store(KEY, ENTRY)
    (dc.path(KEY) / "kernel.cubin").write_bytes(b"truncated")
    deny(dc.path(KEY))
    with pytest.warns(UserWarning, match="is corrupt"):
        assert dc.load(KEY) is None
    with pytest.warns(UserWarning, match=rf"could not store kernel {KEY} .*does not load \(kernel.cubin has 9 bytes"):
        assert dc.store(KEY, ENTRY) is not None
    assert KEY in cache_mod.not_stored
    assert dc.store(OTHER_KEY, ENTRY) is None and OTHER_KEY not in cache_mod.not_stored  # stored: None


def test_a_read_only_cache_serves_its_entries_and_still_builds_the_others(dc, deny, monkeypatch):
    import sys

    jit = sys.modules["tile_ops.jit"]
    dc.store(KEY, ENTRY)
    deny(dc.root)
    assert dc.load(KEY) == ENTRY
    with dc.lock(KEY):  # no lock file can be made: none is taken
        pass

    class Built:
        source, cubin = "// built", b"new"
        meta = type("Meta", (), {"to_json": lambda self: {}})()

    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(dc.root))
    monkeypatch.setattr(jit, "_build", lambda prog, arch, out_idx: (Built(), {}))
    with pytest.warns(UserWarning, match=f"could not store kernel {OTHER_KEY} .*Read-only file system"):
        kernel = jit._load_or_build(OTHER_KEY, lambda: "program", "sm_90a", [2])
    assert isinstance(kernel, Built)  # built in memory, as store()'s failure promises


def test_cache_clear_on_a_read_only_cache_says_what_is_left(dc, deny, monkeypatch, capsys):
    from tile_ops.__main__ import main

    dc.store(KEY, ENTRY)
    deny(dc.root)
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(dc.root))
    assert main(["cache", "clear"]) == 1
    out, err = capsys.readouterr()
    assert "removed 0 entries" in out
    assert f"error: could not remove 1 entry: {dc.path(KEY)} (Read-only file system)" in err
    assert dc.load(KEY) == ENTRY


def test_tune_clear_on_an_unwritable_table_is_a_clear_error(tmp_path, deny, monkeypatch, capsys):
    from tile_ops import autotune
    from tile_ops.__main__ import main
    from tile_ops.kernels.gemm_config import GemmConfig

    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))
    autotune.record("gemm", (64, 64, 64), "float16", "GPU", GemmConfig())
    deny(tmp_path / "cache")
    assert main(["tune", "--clear"]) == 1
    err = capsys.readouterr().err
    assert f"error: could not write the autotune table {tmp_path / 'cache' / 'autotune.json'}" in err
    assert "Read-only file system" in err and "Traceback" not in err
    assert len(autotune.TuneTable().entries()) == 1
