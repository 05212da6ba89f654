"""tile_ops.jit.cache: hits, misses, corruption recovery, atomic stores under races, locking."""

import json
import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import time
import warnings

import pytest

from tile_ops.jit import cache as cache_mod
from tile_ops.jit.cache import CacheEntry, DiskCache, cache_dir

KEY = "ab" + "0123456789abcdef" * 3
SOURCE = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] += 1.0f; }\n'
CUBIN = bytes(range(256)) * 40

# fork: workers only touch the cache (no CUDA), and it avoids re-importing tile_ops per process.
MP = multiprocessing.get_context("fork")


def _entry(cubin=CUBIN, **meta):
    return CacheEntry(source=SOURCE, cubin=cubin, meta=dict({"kernel": "k", "smem": 0}, **meta))


@pytest.fixture
def dc(tmp_path):
    return DiskCache(tmp_path / "cache")


def test_miss_returns_none_without_warning(dc):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dc.load(KEY) is None


def test_hit_roundtrip_and_layout(dc):
    dc.store(KEY, _entry(arch="sm_90a"))
    got = dc.load(KEY)
    assert got == _entry(arch="sm_90a")
    path = dc.root / KEY[:2] / KEY
    assert sorted(p.name for p in path.iterdir()) == ["kernel.cu", "kernel.cubin", "meta.json"]
    meta = json.loads((path / "meta.json").read_text())
    assert meta["files"]["kernel.cubin"]["size"] == len(CUBIN)
    assert len(meta["files"]["kernel.cu"]["sha256"]) == 64
    assert list((dc.root / "tmp").iterdir()) == []  # no temp dir left behind


def test_store_keeps_first_writer(dc):
    dc.store(KEY, _entry(cubin=b"first"))
    dc.store(KEY, _entry(cubin=b"second"))  # silently discarded
    assert dc.load(KEY).cubin == b"first"
    assert list((dc.root / "tmp").iterdir()) == []


def _truncate_cubin(p):
    data = (p / "kernel.cubin").read_bytes()
    (p / "kernel.cubin").write_bytes(data[: len(data) // 2])


def _flip_cubin_byte(p):
    data = bytearray((p / "kernel.cubin").read_bytes())
    data[100] ^= 0xFF
    (p / "kernel.cubin").write_bytes(bytes(data))


def _garble_meta(p):
    (p / "meta.json").write_text('{"files": {"kernel.cu": ')


def _meta_not_a_dict(p):
    (p / "meta.json").write_text("[1, 2, 3]")


def _delete(name):
    return lambda p: (p / name).unlink()


def _edit_description(p):
    """A valid meta.json whose kernel description was changed (issue 45: a grid of 1 was served as cached)."""
    meta = json.loads((p / "meta.json").read_text())
    meta["meta"]["grid"] = [1, 1, 1]
    (p / "meta.json").write_text(json.dumps(meta))


def _another_keys_entry(p):
    """Another key's whole entry copied into this key's directory."""
    meta = json.loads((p / "meta.json").read_text())
    meta["key"] = "f" * len(meta["key"])
    (p / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", [
    _truncate_cubin, _flip_cubin_byte, _garble_meta, _meta_not_a_dict,
    _delete("kernel.cu"), _delete("kernel.cubin"), _delete("meta.json"), _edit_description, _another_keys_entry,
], ids=["truncated-cubin", "flipped-byte", "garbled-meta", "meta-not-dict",
        "no-source", "no-cubin", "no-meta", "edited-description", "another-keys-entry"])
def test_corrupt_entry_warns_is_removed_and_rebuilt(dc, damage):
    dc.store(KEY, _entry())
    path = dc.root / KEY[:2] / KEY
    damage(path)
    with pytest.warns(UserWarning, match=rf"tile_ops: cache entry {KEY} at .* is corrupt \(.+\); rebuilding it"):
        assert dc.load(KEY) is None
    assert not path.exists()
    dc.store(KEY, _entry())  # the caller rebuilds it
    assert dc.load(KEY) == _entry()


def test_invalid_keys_rejected(dc):
    for bad in ["", "../etc", "a/b", ".hidden"]:
        with pytest.raises(ValueError):
            dc.load(bad)


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"
    assert DiskCache().root == tmp_path / "elsewhere"
    monkeypatch.delenv("TILE_OPS_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".tile_ops" / "cache"  # read at call time


def test_info_and_clear(dc):
    assert dc.info() == {"path": str(dc.root), "entries": 0, "bytes": 0}
    keys = [f"{i:02x}" + "f" * 30 for i in range(5)] + ["00" + "e" * 30]
    for k in keys:
        dc.store(k, _entry())
    with dc.lock(keys[0]):
        pass
    info = dc.info()
    assert info["entries"] == len(keys)
    assert info["bytes"] > len(keys) * (len(CUBIN) + len(SOURCE))
    assert dc.clear() == (len(keys), [])
    assert dc.info()["entries"] == 0
    assert all(dc.load(k) is None for k in keys)


def test_clear_removes_only_what_the_cache_wrote(dc):
    """TILE_OPS_CACHE_DIR=$HOME by mistake: `tile_ops cache clear` must not take ~/projects/thesis with it; nor
    the temp dir of a store in progress in another process (only leftovers an hour old)."""
    import time

    dc.store(KEY, _entry())
    theirs = dc.root / "projects" / "thesis"
    theirs.mkdir(parents=True)
    (theirs / "thesis.tex").write_text("years of work")
    look_alike = dc.root / "ab" / "notes"  # a 2-character folder, but not an entry's files
    look_alike.mkdir(parents=True)
    (look_alike / "todo.txt").write_text("x")
    tmp = dc.root / "tmp"  # ($HOME/tmp, with that mistake)
    in_progress, leftover, project = tmp / f"{KEY}.x7k2p9qa", tmp / f"{KEY}.b3n8m1zt", tmp / "myproject"
    for d in (in_progress, leftover, project):
        d.mkdir(parents=True)
    for d in (leftover, project):
        os.utime(d, (time.time() - 7200,) * 2)
    assert dc.info()["entries"] == 1 and dc.clear() == (1, [])
    assert (theirs / "thesis.tex").read_text() == "years of work" and (look_alike / "todo.txt").exists()
    assert in_progress.exists() and project.exists() and not leftover.exists()


def test_clear_removes_an_entry_holding_a_stray_file(dc):
    """A file put in an entry's directory (notes, an editor's backup) made clear skip the entry and report success,
    and load() went on serving it: the directory is the key's (discard() removes it whole too)."""
    dc.store(KEY, _entry())
    (dc.path(KEY) / "notes.txt").write_text("looked at this kernel's SASS")
    assert dc.info()["entries"] == 1
    assert dc.clear() == (1, [])
    assert dc.load(KEY) is None and not dc.path(KEY).exists()


def test_a_store_that_fails_warns_and_the_caller_keeps_its_kernel(dc, monkeypatch):
    monkeypatch.setattr(cache_mod.os, "rename", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.warns(UserWarning, match=f"could not store kernel {KEY} in the cache .*No space left"):
        dc.store(KEY, _entry())
    assert dc.load(KEY) is None


def test_cache_module_does_not_import_tvm_or_torch():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('cache_probe', {cache_mod.__file__!r})\n"
        "m = sys.modules['cache_probe'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n"
        "bad = [n for n in sys.modules if n.split('.')[0] in ('tvm', 'torch', 'tile_ops')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- concurrency ---------------------------------------------------------------------------

RACE_KEYS = [f"{i:02x}" + "c" * 40 for i in range(40)]
PAYLOAD = {"A": b"A" * 50_000, "B": b"B" * 50_000}


def _writer(root, tag, barrier):
    dc = DiskCache(root)
    barrier.wait()
    for k in RACE_KEYS:
        dc.store(k, _entry(cubin=PAYLOAD[tag], writer=tag))


def _reader(root, barrier, done, errors):
    dc = DiskCache(root)
    barrier.wait()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a half-written entry would warn "corrupt"
            while True:
                finished = done.is_set()
                for k in RACE_KEYS:
                    e = dc.load(k)
                    if e is not None and e.cubin != PAYLOAD[e.meta["writer"]]:
                        raise AssertionError(f"mixed entry for {k}")
                if finished:
                    break
    except BaseException as e:  # noqa: BLE001
        errors.put(repr(e))


def test_concurrent_stores_publish_one_valid_entry(tmp_path):
    root = tmp_path / "cache"
    barrier, done, errors = MP.Barrier(3), MP.Event(), MP.Queue()
    writers = [MP.Process(target=_writer, args=(root, t, barrier)) for t in "AB"]
    reader = MP.Process(target=_reader, args=(root, barrier, done, errors))
    for p in writers + [reader]:
        p.start()
    for p in writers:
        p.join(60)
        assert p.exitcode == 0
    done.set()
    reader.join(60)
    assert reader.exitcode == 0
    assert errors.empty(), errors.get()
    dc = DiskCache(root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in RACE_KEYS:
            e = dc.load(k)
            assert e is not None and e.cubin == PAYLOAD[e.meta["writer"]]
    assert dc.info()["entries"] == len(RACE_KEYS)
    assert list((root / "tmp").iterdir()) == []  # losers cleaned up their temp dirs


N_INCREMENTS = 200


def _incrementer(root, counter, barrier):
    dc = DiskCache(root)
    barrier.wait()
    for _ in range(N_INCREMENTS):
        with dc.lock(KEY):
            value = int(counter.read_text())
            os.sched_yield()  # widen the read-modify-write window
            counter.write_text(str(value + 1))


def test_lock_serializes_processes(tmp_path):
    root, counter = tmp_path / "cache", tmp_path / "counter"
    counter.write_text("0")
    barrier = MP.Barrier(3)
    procs = [MP.Process(target=_incrementer, args=(root, counter, barrier)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert int(counter.read_text()) == 3 * N_INCREMENTS
    assert (root / "locks" / f"{KEY}.lock").exists()


def _hold_lock(root, ready):
    with DiskCache(root).lock(KEY):
        ready.set()
        time.sleep(600)


@pytest.fixture
def stopped_holder(tmp_path):
    """A process holding KEY's lock, stopped (SIGSTOP) as a compile suspended with Ctrl-Z is."""
    ready = MP.Event()
    holder = MP.Process(target=_hold_lock, args=(tmp_path / "cache", ready), daemon=True)
    holder.start()
    assert ready.wait(30)
    os.kill(holder.pid, signal.SIGSTOP)
    yield holder
    holder.kill()  # SIGKILL ends a stopped process too
    holder.join(30)


def _take_lock(root, results):
    """Puts (what happened, its message, the warnings, the seconds it took) on ``results``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0, outcome = time.monotonic(), ("locked", "")
        try:
            with DiskCache(root).lock(KEY):
                pass
        except Exception as e:  # noqa: BLE001 - sent to the test
            outcome = (type(e).__name__, str(e))
        results.put((*outcome, [str(w.message) for w in caught], time.monotonic() - t0))


def test_a_lock_wait_names_its_holder_then_gives_up(tmp_path, monkeypatch, stopped_holder):
    """A blocking flock waited silently, for ever, on a stopped compile: every process needing that key hung."""
    monkeypatch.setenv("TILE_OPS_LOCK_TIMEOUT", "1.5")
    monkeypatch.setattr(cache_mod, "_LOCK_REPORT_S", 0.3)  # (5 s by default)
    results = MP.Queue()
    waiter = MP.Process(target=_take_lock, args=(tmp_path / "cache", results))  # a process: a hang can be ended
    waiter.start()
    waiter.join(60)
    if waiter.is_alive():
        waiter.kill()
        pytest.fail("the lock wait had no bound")
    kind, message, warned, waited = results.get(timeout=10)
    lock_file = tmp_path / "cache" / "locks" / f"{KEY}.lock"
    assert kind == "LockTimeout" and 1.5 <= waited < 30, (kind, message)
    for part in (f"cache key {KEY}", f"{lock_file} is held by pid {stopped_holder.pid} (STOPPED", "end it",
                 "TILE_OPS_LOCK_TIMEOUT=SECONDS to wait longer (now 1.5"):
        assert part in message, message
    assert [w for w in warned if f"waiting for the lock of cache key {KEY}: {lock_file} is held by pid "
            f"{stopped_holder.pid}" in w], warned


def test_the_lock_file_records_its_holder_while_held(dc):
    lock_file = dc.root / "locks" / f"{KEY}.lock"
    with dc.lock(KEY):
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    assert lock_file.read_text() == ""  # released: a later holder that cannot write is not named as us


def test_lock_timeout_setting(monkeypatch):
    monkeypatch.delenv("TILE_OPS_LOCK_TIMEOUT", raising=False)
    assert cache_mod.lock_timeout() == 600
    monkeypatch.setenv("TILE_OPS_LOCK_TIMEOUT", "inf")
    assert cache_mod.lock_timeout() == float("inf")
    for bad in ("0", "-5", "soon", "nan"):
        monkeypatch.setenv("TILE_OPS_LOCK_TIMEOUT", bad)
        with pytest.raises(ValueError, match=rf"TILE_OPS_LOCK_TIMEOUT='{bad}' is not a time .*accepted: a positive "
                                             r"number of seconds \(default 600\), or inf"):
            with DiskCache("/nonexistent/cache").lock(KEY):  # refused before any file is touched
                pass


def test_nested_locks_on_different_keys(dc):
    with dc.lock(KEY), dc.lock("cd" + "1" * 30):
        dc.store(KEY, _entry())
    assert dc.load(KEY) is not None


@pytest.mark.parametrize("sub", ["lang", "compiler", "compiler/schedules", "compiler/ops", "kernels", "jit/build.py"])
def test_compiler_fingerprint_covers_the_kernel_library(tmp_path, monkeypatch, sub):
    """A library factory's cache key has its own source, not its helpers' (e.g. the gemm factory's epilogue
    choice): editing any file of the language, the compiler, the kernel library or the nvcc build step must
    invalidate kernels, in its subpackages too."""
    import shutil

    jit = sys.modules["tile_ops.jit"]  # the package (tile_ops.jit the attribute is the decorator)
    pkg = tmp_path / "tile_ops"
    for d in jit.FINGERPRINTED:
        src, dst = os.path.join(jit._PKG, d), pkg / d
        dst.parent.mkdir(parents=True, exist_ok=True)
        if os.path.isdir(src):
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dst)
    monkeypatch.setattr(jit, "_PKG", str(pkg))
    before = jit.compiler_fingerprint.__wrapped__()
    helper = pkg / sub if sub.endswith(".py") else next((pkg / sub).glob("*.py"))
    helper.write_text(helper.read_text() + "\n# edited\n")
    assert jit.compiler_fingerprint.__wrapped__() != before


BLOCK = 64  # read by _reads_a_global below


def test_the_key_sees_the_globals_and_closure_a_factory_reads():
    """A factory reading a module constant or a closure cell builds another program when that value changes:
    the cache key (in memory and on disk) must change with it, and stay the same across processes."""
    import tile_ops

    def make(threads):
        @tile_ops.jit(out_idx=[1])
        def _reads_a_global(n):
            return (n, BLOCK, threads)  # never traced here: only the keys are compared

        return _reads_a_global

    f128, f256 = make(128), make(256)
    key = f128.key((1024,), {}, "sm_90a")
    assert f256.key((1024,), {}, "sm_90a") != key  # the closure's threads
    global BLOCK
    BLOCK = 128
    try:
        assert f128.key((1024,), {}, "sm_90a") != key  # the module's BLOCK
        env = dict(zip(f128.environment_names(), f128.environment()))
        assert env["BLOCK"] == 128 and env["threads"] == 128
    finally:
        BLOCK = 64
    assert make(128).key((1024,), {}, "sm_90a") == key  # values, not identities
    from tile_ops.jit import _stable
    from tile_ops.kernels.gemm import gemm  # a library factory: its helpers by name and source, no addresses

    assert "0x" not in json.dumps([_stable(v) for v in gemm.environment()])


def test_equal_arguments_of_other_types_are_other_kernels(monkeypatch):
    """1 == 1.0 == True share a hash: the per-call table must not hand one's kernel to another (a factory may
    divide by it, or branch on it), as the full key does not."""
    import tile_ops

    jit = sys.modules["tile_ops.jit"]
    monkeypatch.setattr(jit, "_load_or_build", lambda key, trace, arch, out_idx: key)

    @tile_ops.jit(out_idx=[1])
    def f(x, flag=0):
        return x

    assert len({f(1), f(1.0), f(True), f(1, flag=False), f(1, flag=0.0)}) == 5
    assert len({f((1, 2)), f((1.0, 2)), f(1, flag=((0,),)), f(1, flag=((0.0,),))}) == 4  # inside tuples too
    assert f(1.0) == f(1.0)


FACTORY = """
import tile_ops

def _relu(x):
    return x

ACTS = {"relu": _relu}
TAGS = {"b", "a", "c", "d", "e"}

@tile_ops.jit(out_idx=[1])
def f(n):
    return (n, ACTS, TAGS, later)
"""


def test_the_key_is_the_same_in_every_process(tmp_path):
    """Containers of functions and sets (iterated in hash-seed order) in what a factory reads: one key in every
    process, or the disk cache never hits and grows by an entry a process."""
    (tmp_path / "factory_mod.py").write_text(FACTORY)
    code = "import factory_mod; print(factory_mod.f.key((8,), {}, 'sm_90a'))"
    keys = {subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED=str(seed))).stdout for seed in (1, 2, 3)}
    assert len(keys) == 1, keys


def test_a_closure_cell_assigned_later_is_not_an_error():
    import tile_ops

    def make():
        @tile_ops.jit(out_idx=[1])
        def g(n):
            return (n, late)

        before = g.key((8,), {}, "sm_90a")  # `late` unassigned: not ValueError('Cell is empty')
        late = 4  # noqa: F841
        return before, g.key((8,), {}, "sm_90a")

    before, after = make()
    assert before != after


ARGS_FACTORY = """
import tile_ops

def relu(x):
    return x

@tile_ops.jit(out_idx=[1])
def f(n, act=None, tags=frozenset()):
    return (n, act, tags)
"""


def test_arguments_are_keyed_the_same_in_every_process(tmp_path):
    """A function argument was keyed by its address, a set by its hash-seed order: a new disk key every process."""
    (tmp_path / "args_mod.py").write_text(ARGS_FACTORY)
    code = ("import args_mod as m; print(m.f.key((8,), {'act': m.relu}, 'sm_90a'), "
            "m.f.key((8,), {'tags': frozenset('abcdefgh')}, 'sm_90a'))")
    keys = {subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED=str(seed))).stdout for seed in (1, 2, 3)}
    assert len(keys) == 1, keys


def _relu(x):
    return "relu"


def _gelu(x):
    return "gelu"


ACT = None  # read by the factory below


def test_partials_are_keyed_by_function_and_arguments_and_addresses_refused(monkeypatch):
    """partial(relu) and partial(gelu) were both keyed as 'partial' (their text holds an address): the gelu program
    was served the relu kernel."""
    import functools

    import tile_ops

    jit = sys.modules["tile_ops.jit"]
    monkeypatch.setattr(jit, "_load_or_build", lambda key, trace, arch, out_idx: trace())

    @tile_ops.jit(out_idx=[1])
    def f(n, scale=None):
        return f"applies {ACT(0)}"

    monkeypatch.setattr(sys.modules[__name__], "ACT", functools.partial(_relu))
    relu_key = f.key((8,), {}, "sm_90a")
    assert f(8, target="sm_90a") == "applies relu"
    monkeypatch.setattr(sys.modules[__name__], "ACT", functools.partial(_gelu))
    assert f(8, target="sm_90a") == "applies gelu"
    assert f.key((8,), {}, "sm_90a") != relu_key
    assert f.key((8,), {"scale": functools.partial(_relu, 2)}, "sm_90a") != \
        f.key((8,), {"scale": functools.partial(_relu, 3)}, "sm_90a")
    monkeypatch.setattr(sys.modules[__name__], "ACT", functools.partial(_relu))
    assert f.key((8,), {}, "sm_90a") == relu_key  # values, not identities

    class Activation:  # the default repr: an address, the same text kind for any two instances
        pass

    monkeypatch.setattr(sys.modules[__name__], "ACT", Activation())
    with pytest.raises(TypeError, match=r"ACT, which .*f reads, is <.*Activation object at 0x.*>, which cannot key a "
                                        r"kernel: .*\(accepted: numbers, strings, .*functools.partial"):
        f(8, target="sm_90a")
    monkeypatch.setattr(sys.modules[__name__], "ACT", functools.partial(_relu))
    with pytest.raises(TypeError, match=r"the argument scale of .*f is <.*Activation object"):
        f.key((8,), {"scale": [Activation()]}, "sm_90a")
