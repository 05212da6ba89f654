"""tile_ops.autotune on the CPU: config spaces and pruning, the tuned table (persistence, bucket rule,
concurrent writers), the ops' config selection, the tuner with a fake timer (real sm_90a compiles),
and the ``tune`` command.  One GPU test tunes a small shape end to end."""

import dataclasses
import errno
import importlib
import json
import os
import pathlib
import subprocess
import sys
import time
import types
import warnings

import pytest
import torch

from tile_ops import autotune
from tile_ops.autotune import bench, table, targets
from tile_ops.autotune.progress import _Bar
from tile_ops.autotune.tuner import make_candidates, prune, smem_limit
from tile_ops.jit.build import _find_tool
from tile_ops.kernels import gemm as gemm_programs
from tile_ops.kernels import gemm_defaults, gemm_launch, gemm_space
from tile_ops.kernels import gemm_softmax as softmax_programs
from tile_ops.kernels import gemm_softmax_defaults as softmax_defaults
from tile_ops.kernels import gemm_softmax_launch as softmax_launch
from tile_ops.kernels.attention_config import AttentionConfig
from tile_ops.kernels.gemm_config import GemmConfig
from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig

GemmTarget = importlib.import_module("tile_ops.ops.gemm").GemmTarget  # (tile_ops.ops.gemm is the function)
needs_nvcc = pytest.mark.skipif(_find_tool("nvcc", "TILE_OPS_NVCC") is None, reason="nvcc not installed")
FAKE_GPU = "FAKE GPU"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))
    autotune.reload()
    yield
    autotune.reload()


@pytest.fixture
def fake_gpu(monkeypatch):
    """The table lookups see a GPU named FAKE_GPU (tensors stay on the CPU)."""
    monkeypatch.setattr(table, "gpu_name", lambda device=None: FAKE_GPU)


def subprocess_env() -> dict:
    """This checkout first on the path, and no GPU (the CPU path even on a GPU machine)."""
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), CUDA_VISIBLE_DEVICES="")


# ------------------------------------------------------------------------------------ config spaces
@pytest.mark.parametrize("op, shape", [("gemm", (4096, 4096, 4096)), ("gemm", (16, 8192, 8192)),
                                       ("gemm", (1000, 1000, 1000)), ("gemm_softmax", (8192, 2048, 1024)),
                                       ("gemm_softmax", (200, 96, 64)), ("flash_attention", (4096, 32, 128)),
                                       ("flash_attention", (512, 8, 256))])
def test_config_space_is_declared_by_the_kernel_and_round_trips_json(op, shape):
    target = targets.get(op)
    space = target.config_space(shape, "float16", "sm_90a")
    assert space and len(set(space)) == len(space)
    assert all(type(c) is target.config_class() for c in space)
    for c in space:
        assert autotune.config_from_dict(op, json.loads(json.dumps(autotune.config_to_dict(c)))) == c
    cands = make_candidates(target, shape, "float16", "sm_90a")
    assert target.default_config(shape, "sm_90a") in [c.config for c in cands]  # the heuristic is a candidate
    assert len(cands) == len({c.config for c in cands})


@pytest.mark.parametrize("arch", ["sm_90", "sm_90a"])
def test_gemm_space_fits_the_problem(arch):
    decode = gemm_space.config_space(16, 8192, 8192, arch=arch)
    if arch == "sm_90a":  # wgmma: 64-row tiles, thin N so B streams from every SM, K split over 1, 2 or 4 CTAs;
        # or swapped (C^T = B^T A^T): M's 16 rows along wgmma's n
        assert {c.block_M for c in decode if not c.swap_ab} == {64} and min(c.block_N for c in decode) == 32
        assert {c.block_M for c in decode if c.swap_ab} == {16}
        assert {c.split_k for c in decode} == {1, 2, 4}
    else:
        assert {c.block_M for c in decode} == {16} and {c.policy for c in decode} == {"full_col"}
        assert {c.split_k for c in decode} == {1}
    big = gemm_space.config_space(4096, 4096, 4096, arch=arch)
    assert {c.swizzle for c in big} == ({0, 4, 8} if arch == "sm_90a" else {0, 8}) and {c.policy for c in big} == {"square"} and {c.split_k for c in big} == {1}
    assert {(c.block_M, c.block_N) for c in big} >= {(128, 128), (128, 256), (256, 128)}
    assert max(c.block_N for c in gemm_space.config_space(512, 64, 512, arch=arch)) == 64
    if arch == "sm_90a":  # short grids: 64x128 pairs sharing B, and the same tiles unclustered
        short = gemm_space.config_space(1024, 1024, 4096, arch=arch)
        assert {(c.block_K, c.num_stages, c.cluster) for c in short if (c.block_M, c.block_N) == (64, 128)
                and c.epilogue == "shared" and c.swizzle == 8} >= {(64, 8, 2), (64, 8, 1), (128, 4, 2), (128, 4, 1)}


def test_prune_skips_configs_over_the_shared_memory_limit():
    target, shape = targets.get("gemm"), (4096, 4096, 4096)
    cands = make_candidates(target, shape, "float16", "sm_86")
    prune(target, cands, shape, "float16", smem_limit("sm_86"))
    skipped = [c for c in cands if c.skipped]
    assert skipped and all(c.skipped.startswith("shared memory: needs ~") and "101376 B" in c.skipped
                           for c in skipped)
    assert all(target.shared_memory_bytes(c.config, shape, "float16") > 101376 for c in skipped)
    cands = make_candidates(target, shape, "float16", "sm_90a")
    prune(target, cands, shape, "float16", smem_limit("sm_90a"))
    assert not any(c.skipped for c in cands if c.config == target.default_config(shape, "sm_90a"))
    assert all(target.shared_memory_bytes(c.config, shape, "float16") > 232448 for c in cands if c.skipped)
    assert smem_limit("sm_90a") == 232448 and smem_limit("sm_80") == 166912


@pytest.mark.parametrize("op, cfg, shape", [
    ("gemm", GemmConfig(128, 256, 64, 3, 256, 8), (1024, 1024, 1024)),
    ("gemm", GemmConfig(16, 128, 128, 2, 128, 0, "full_col"), (16, 512, 512)),
    # one tile a CTA: the bias and output tiles lie over the stages (4 of 128x256, or 5 of 192x128 swapped)
    ("gemm", GemmConfig(128, 256, 64, 4, 256, 0, epilogue="shared"), (2048, 2048, 1024)),
    ("gemm", GemmConfig(192, 128, 64, 5, 256, 8, epilogue="shared", swap_ab=True), (1500, 2000, 512)),
    ("gemm", GemmConfig(128, 256, 64, 3, 256, 4, epilogue="shared"), (4096, 4096, 1024)),  # persistent: beside
    ("gemm_softmax", SoftmaxConfig(128, 256, 64, 3, 256, "full_row", persistent=False), (8192, 256, 512)),
    ("gemm_softmax", SoftmaxConfig(128, 64, 32, 3, 256), (512, 2048, 256)),
    ("gemm_softmax", SoftmaxConfig(64, 128, 64, 2, 128, "full_row"), (200, 96, 64)),
])
def test_shared_memory_estimate_bounds_the_compiler(op, cfg, shape):
    from tile_ops.compiler import compile_program

    M, N, K = shape
    if op == "gemm":
        prog = gemm_programs.gemm.fn(M, N, K, 1, 1, 1, False, False, True, "float16", "float16", cfg)
    else:
        prog = softmax_programs.gemm_softmax.fn(M, N, K, 1.0, "float16", "float16", cfg)
    used = compile_program(prog, "sm_90a").meta.smem_bytes
    estimate = targets.get(op).shared_memory_bytes(cfg, shape, "float16")
    assert used <= estimate <= used + 4096, (used, estimate)


# ---------------------------------------------------------------------------------------- the table
def test_bucket_rule():
    assert [autotune.shape_bucket(m) for m in (1, 2, 3, 64, 65, 1000, 1024, 1025)] == [1, 2, 4, 64, 128, 1024,
                                                                                          1024, 2048]
    a, b = GemmConfig(64, 64, 32, 3, 128, 0), GemmConfig(128, 64, 32, 3, 128, 0)
    autotune.record("gemm", (1000, 512, 256), "float16", FAKE_GPU, a)
    autotune.record("gemm", (600, 512, 256), "float16", FAKE_GPU, b)

    def look(M, N=512, K=256, dtype="float16", gpu=FAKE_GPU):
        return autotune.lookup("gemm", (M, N, K), dtype, gpu)

    assert look(1000) == a and look(600) == b  # exact shapes
    assert look(900) == a and look(700) == b and look(513) == b  # same bucket (513..1024), nearest M
    assert look(1025) is None and look(512) is None  # other buckets
    assert look(1000, N=1024) is None and look(1000, K=128) is None  # N and K must match
    assert look(1000, dtype="bfloat16") is None and look(1000, gpu="OTHER GPU") is None
    assert look(1000, gpu=None) is None


def test_table_file_format_and_location(tmp_path):
    cfg = SoftmaxConfig(64, 64, 32, 3, 128, "full_row")
    key = autotune.record("gemm_softmax", (256, 128, 64), "bfloat16", FAKE_GPU, cfg, ms=0.5, default_ms=0.6)
    path = tmp_path / "cache" / "autotune.json"
    assert autotune.table_path() == path
    data = json.loads(path.read_text())
    assert data["version"] == 1 and list(data["entries"]) == [key] == [f"{FAKE_GPU}|gemm_softmax|bfloat16|256x128x64"]
    entry = data["entries"][key]
    assert entry["config"] == dataclasses.asdict(cfg) and entry["shape"] == [256, 128, 64]
    assert entry["ms"] == 0.5 and entry["default_ms"] == 0.6 and entry["gpu"] == FAKE_GPU and entry["tuned_at"]
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]  # no temp file left behind


_PROCESS = """
import pathlib, sys, time
from tile_ops import autotune
from tile_ops.kernels.gemm_config import GemmConfig
print(autotune.lookup("gemm", (30, 4096, 4096), "float16", "FAKE GPU"))  # the parent's entry, M in its bucket
tag, sync = sys.argv[1], pathlib.Path(sys.argv[2])
(sync / ("ready-" + tag)).touch()
while not (sync / "go").exists():  # start writing together
    time.sleep(0.001)
for i in range(40):
    autotune.record("gemm", (64 * (i + 1), 512, 512), "float16", "GPU " + tag, GemmConfig(64, 64, 32, 3, 128, 0))
"""


def test_table_is_read_by_new_processes_and_concurrent_writers_merge(tmp_path):
    cfg = GemmConfig(64, 128, 64, 4, 128, 0, "full_col")
    autotune.record("gemm", (32, 4096, 4096), "float16", FAKE_GPU, cfg, ms=0.1)
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, tag, str(tmp_path)], env=subprocess_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for tag in ("A", "B")]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-{tag}").exists() for tag in "AB"):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a writer did not start"
        time.sleep(0.01)
    (tmp_path / "go").touch()
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.strip() == repr(cfg)
    entries = autotune.TuneTable().entries()
    assert len(entries) == 81  # no writer lost another's keys
    assert {e["gpu"] for e in entries.values()} == {FAKE_GPU, "GPU A", "GPU B"}


def test_corrupt_or_stale_table_falls_back_with_a_warning(fake_gpu):
    path = autotune.table_path()
    path.parent.mkdir(parents=True)
    path.write_text('{"version": 1, "entries": {')  # truncated
    with pytest.warns(UserWarning, match="ignoring the autotune table"):
        assert autotune.config_for("gemm", 256, 256, 256, "float16") == gemm_defaults.default_config(256, 256, 256)
    cfg = GemmConfig(64, 64, 32, 3, 128, 0)
    with pytest.warns(UserWarning, match="ignoring the autotune table"):
        autotune.record("gemm", (256, 256, 256), "float16", FAKE_GPU, cfg)  # rewrites the file whole
    assert autotune.config_for("gemm", 256, 256, 256, "float16") == cfg

    entries = autotune.TuneTable().entries()
    entries[next(iter(entries))]["config"]["warpgroups_removed_field"] = 2
    path.write_text(json.dumps({"version": 1, "entries": entries}))
    autotune.reload()
    with pytest.warns(UserWarning, match="no field"):
        assert autotune.config_for("gemm", 256, 256, 256, "float16") == gemm_defaults.default_config(256, 256, 256)


def test_a_writer_keeps_a_table_it_cannot_read():
    """Another version's table (a newer tile_ops sharing the cache) is not replaced by one entry of ours; an
    unparsable file is set aside, not lost."""
    path = autotune.TuneTable().path
    path.parent.mkdir(parents=True, exist_ok=True)
    theirs = '{"version": 2, "entries": {"a": {}, "b": {}, "c": {}}}'
    path.write_text(theirs)
    with pytest.raises(RuntimeError, match="is version 2, not 1 .*not writing over it"):
        autotune.record("gemm", (64, 64, 64), "float16", FAKE_GPU, GemmConfig())
    assert path.read_text() == theirs
    path.write_text('{"version": 1, "entr')
    with pytest.warns(UserWarning, match="kept as autotune.json.unreadable"):
        autotune.record("gemm", (64, 64, 64), "float16", FAKE_GPU, GemmConfig())
    assert path.with_name("autotune.json.unreadable").read_text() == '{"version": 1, "entr'
    assert list(autotune.TuneTable().entries()) == [table.entry_key(FAKE_GPU, "gemm", "float16", (64, 64, 64))]
    path.write_text(theirs)
    assert autotune.TuneTable().clear() == 0 and autotune.TuneTable().entries() == {}  # asked for: cleared


def test_clear():
    autotune.record("gemm", (64, 64, 64), "float16", FAKE_GPU, GemmConfig())
    assert autotune.TuneTable().clear() == 1 and autotune.TuneTable().entries() == {}


def test_a_transient_read_error_leaves_the_table_alone(monkeypatch):
    """EMFILE while a writer read the table: the good table was renamed aside as unreadable, every entry gone."""
    for M in (256, 512):
        autotune.record("gemm", (M, 4096, 4096), "float16", FAKE_GPU, GemmConfig())
    path = autotune.table_path()
    before, read_text = path.read_text(), pathlib.Path.read_text

    def too_many_open_files(self, *args, **kwargs):
        if self == path:
            raise OSError(errno.EMFILE, "Too many open files")
        return read_text(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "read_text", too_many_open_files)
        with pytest.raises(OSError, match="could not write the autotune table .*Too many open files"):
            autotune.record("gemm", (1024, 4096, 4096), "float16", FAKE_GPU, GemmConfig())
    assert path.read_text() == before
    assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith("autotune")) == ["autotune.json"]


def test_each_unreadable_table_is_kept_under_its_own_name():
    path = autotune.table_path()
    path.parent.mkdir(parents=True)
    garbage = ['{"version": 1, "entr', "[1, 2]", '{"version": 1, "entries": []}', b"\xff\xfe"]
    for content in garbage:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.warns(UserWarning, match="ignoring the autotune table .*; kept as autotune.json.unreadable"):
            autotune.record("gemm", (64, 64, 64), "float16", FAKE_GPU, GemmConfig())
    kept = [path.with_name("autotune.json.unreadable" + suffix) for suffix in ("", ".1", ".2", ".3")]
    assert [p.read_bytes() for p in kept] == [c if isinstance(c, bytes) else c.encode() for c in garbage]
    assert len(autotune.TuneTable().entries()) == 1


def test_one_shape_tuned_for_two_archs_keeps_both(fake_gpu, capsys):
    """sm_90a and sm_90 runs on one GPU: the key had no arch, so the second overwrote the first and the ops of the
    first arch fell back to the default."""
    from tile_ops.__main__ import main

    shape = (4096, 4096, 4096)
    hopper = GemmConfig(128, 256, 64, 4, 256, 8, epilogue="shared", cluster=2)
    ampere = GemmConfig(128, 128, 32, 3, 256, 8)
    autotune.record("gemm", shape, "float16", FAKE_GPU, hopper, ms=0.2, arch="sm_90a")
    autotune.record("gemm", shape, "float16", FAKE_GPU, ampere, ms=0.35, arch="sm_90")
    assert sorted(autotune.TuneTable().entries()) == [f"{FAKE_GPU}|gemm|float16|4096x4096x4096|{arch}"
                                                      for arch in ("sm_90", "sm_90a")]
    assert autotune.config_for("gemm", *shape, "float16", arch="sm_90a") == hopper
    assert autotune.config_for("gemm", *shape, "float16", arch="sm_90") == ampere
    assert main(["tune", "--show"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:5] == ["gpu", "op", "dtype", "arch", "shape"]
    assert sorted(line.split("float16")[1].split()[0] for line in lines[2:]) == ["sm_90", "sm_90a"]


def test_keys_without_the_arch_still_read_and_are_superseded_for_their_arch(fake_gpu):
    old_key = f"{FAKE_GPU}|gemm|float16|1024x1024x1024"  # the key before it had the arch
    a, b = GemmConfig(64, 64, 32, 3, 128, 0), GemmConfig(128, 64, 32, 3, 128, 0)
    autotune.TuneTable().update({old_key: {"gpu": FAKE_GPU, "op": "gemm", "dtype": "float16", "shape": [1024] * 3,
                                           "config": dataclasses.asdict(a), "arch": "sm_90a"}})
    assert autotune.config_for("gemm", 1024, 1024, 1024, "float16", arch="sm_90a") == a
    autotune.record("gemm", (1024, 1024, 1024), "float16", FAKE_GPU, b, arch="sm_90")  # another arch: both kept
    assert autotune.config_for("gemm", 1024, 1024, 1024, "float16", arch="sm_90a") == a
    autotune.record("gemm", (1024, 1024, 1024), "float16", FAKE_GPU, b, arch="sm_90a")  # its arch: replaced
    assert sorted(autotune.TuneTable().entries()) == [old_key + "|sm_90", old_key + "|sm_90a"]
    assert autotune.config_for("gemm", 1024, 1024, 1024, "float16", arch="sm_90a") == b


def test_entries_with_wrong_value_types_are_skipped_with_one_warning(fake_gpu, capsys):
    """Valid JSON, wrong types (a hand edit): lookup() raised TypeError on every gemm call of that (GPU, N, K) and
    `tune --show` a traceback."""
    from tile_ops.__main__ import main

    cfg = GemmConfig(64, 64, 32, 3, 128, 0)
    good = {"gpu": FAKE_GPU, "op": "gemm", "dtype": "float16", "shape": [1000, 512, 256],
            "config": dataclasses.asdict(cfg), "ms": 0.2, "default_ms": 0.3}
    bad = {"m-string": {**good, "shape": ["1000", 512, 256]}, "m-null": {**good, "shape": [None, 512, 256]},
           "not-a-list": {**good, "shape": 1000}, "ms-string": {**good, "shape": [600, 512, 256], "ms": "0.2"},
           "gpu-number": {**good, "gpu": 7}, "arch-list": {**good, "arch": ["sm_90a"]}}
    autotune.TuneTable().update({"good": good, **bad})
    with pytest.warns(UserWarning, match=r"ignoring 6 malformed entries of the autotune table .*'m-null' \(shape "
                                         r"\[None, 512, 256\] is not three positive integers\)") as warned:
        assert autotune.config_for("gemm", 900, 512, 256, "float16", arch="sm_90a") == cfg
    assert len(warned) == 1
    assert "'ms-string' (ms '0.2' is not a positive number)" in str(warned[0].message)
    with pytest.warns(UserWarning, match="ignoring 6 malformed entries"):
        assert main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert "(1 entry)" in out and "1000x512x256" in out and "1.50x" in out


# ------------------------------------------------------------------------------ what the ops launch
def test_gemm_op_launches_the_tuned_config_else_the_default(fake_gpu, monkeypatch):
    seen = []
    monkeypatch.setattr(gemm_launch, "gemm", lambda *args, **kw: seen.append(args[-1]))
    a, b = torch.randn(1, 300, 256, dtype=torch.float16), torch.randn(1, 256, 512, dtype=torch.float16)
    out = torch.empty(1, 300, 512, dtype=torch.float16)
    gemm_launch.get_gemm_kernel(a, b, out)
    assert seen[-1] == gemm_defaults.default_config(300, 512, 256)

    tuned = GemmConfig(64, 128, 64, 2, 128, 0)
    autotune.record("gemm", (500, 512, 256), "float16", FAKE_GPU, tuned)  # 300 is in 500's bucket (257..512)
    gemm_launch.get_gemm_kernel(a, b, out)
    assert seen[-1] == tuned
    gemm_launch.get_gemm_kernel(a.bfloat16(), b.bfloat16(), out.bfloat16())
    assert seen[-1] == gemm_defaults.default_config(300, 512, 256)  # tuned for float16 only
    explicit = GemmConfig(128, 64, 32, 3, 128, 0)
    gemm_launch.get_gemm_kernel(a, b, out, cfg=explicit)
    assert seen[-1] == explicit


def test_a_tuned_config_that_cannot_build_here_gives_way_to_the_default(fake_gpu, monkeypatch):
    """1024's tuned pairs of 64-row tiles (cluster 2) reach 520 through the bucket rule: 9 row tiles, which a
    cluster of 2 cannot divide. That M gets its default instead of a ValueError from every call."""
    seen, factory = [], gemm_programs.gemm
    monkeypatch.setattr(gemm_launch, "gemm", lambda *args, **kw: seen.append(args[-1]))
    pairs = GemmConfig(64, 128, 64, 8, 128, 8, epilogue="shared", cluster=2)
    autotune.record("gemm", (1024, 1024, 1024), "float16", FAKE_GPU, pairs)
    for M, expected in ((1024, pairs), (640, pairs), (520, gemm_defaults.default_config(520, 1024, 1024))):
        a, b = torch.randn(1, M, 1024, dtype=torch.float16), torch.randn(1, 1024, 1024, dtype=torch.float16)
        gemm_launch.get_gemm_kernel(a, b, torch.empty(1, M, 1024, dtype=torch.float16))
        assert seen[-1] == expected, M
    with pytest.raises(ValueError, match="cluster=2 must divide the 9 row tiles of M=520"):  # asked for: refused
        factory.fn(520, 1024, 1024, cfg=pairs)
    # precompile builds what the op launches: the same choice
    assert gemm_launch.launch_config(520, 1024, 1024, "float16") == gemm_defaults.default_config(520, 1024, 1024)
    assert gemm_launch.launch_config(640, 1024, 1024, "float16") == pairs


def test_gemm_softmax_op_launches_the_tuned_config(fake_gpu, monkeypatch):
    seen = []

    class FakeKernel:
        def launcher(self, device):
            return lambda ptrs, dims=(): None

    monkeypatch.setattr(softmax_launch, "gemm_softmax", lambda *args, **kw: seen.append(args[-1]) or FakeKernel())
    a, b = torch.randn(128, 64, dtype=torch.float16), torch.randn(64, 96, dtype=torch.float16)
    out = torch.empty(128, 96, dtype=torch.float16)
    softmax_launch.launch_gemm_softmax(a, b, out)
    assert seen[-1] == softmax_defaults.default_config(128, 96, 64)
    tuned = SoftmaxConfig(128, 64, 64, 2, 256, "full_row")
    autotune.record("gemm_softmax", (128, 96, 64), "float16", FAKE_GPU, tuned)
    softmax_launch.launch_gemm_softmax(a, b, out)
    assert seen[-1] == tuned


def test_an_entry_serves_only_the_arch_it_was_tuned_for(fake_gpu):
    """A config tuned on the sm_90a path (clusters, TMA) is not the sm_80 build's: precompile --arch sm_80
    would fail on it."""
    clustered = GemmConfig(128, 128, 64, 4, 128, 0, epilogue="shared", cluster=2)
    autotune.record("gemm", (1024, 1024, 1024), "float16", FAKE_GPU, clustered, arch="sm_90a")
    assert autotune.config_for("gemm", 1024, 1024, 1024, "float16", arch="sm_90a") == clustered
    assert autotune.config_for("gemm", 1024, 1024, 1024, "float16", arch="sm_80") == \
        gemm_defaults.default_config(1024, 1024, 1024, "sm_80")
    assert table.lookup("gemm", (1024, 1024, 1024), "float16", FAKE_GPU) == clustered  # no arch asked: any


def test_no_gpu_means_the_default(monkeypatch):
    tuned = GemmConfig(64, 128, 64, 4, 128, 0)
    autotune.record("gemm", (16, 4096, 4096), "float16", FAKE_GPU, tuned)
    assert table.gpu_name("cpu") is None
    assert autotune.config_for("gemm", 16, 4096, 4096, "float16", torch.device("cpu")) == \
        gemm_defaults.default_config(16, 4096, 4096)
    monkeypatch.setattr(table, "gpu_name", lambda device=None: FAKE_GPU)  # the entry is there for a GPU
    autotune.reload()  # (config_for memoizes per device)
    assert autotune.config_for("gemm", 16, 4096, 4096, "float16", torch.device("cpu")) == tuned


# ------------------------------------------------------------------- the tuner, with a fake timer
@needs_nvcc
def test_tune_picks_the_fastest_and_skips_failures_with_reasons(fake_gpu):
    shape = (128, 128, 64)
    fast = GemmConfig(64, 64, 32, 2, 128, 0)
    wrong = GemmConfig(64, 128, 32, 2, 128, 0)
    crashes = GemmConfig(128, 64, 32, 2, 128, 0)
    untileable = GemmConfig(16, 64, 32, 2, 256, 0, "full_row")  # 8 warps cannot split 16 rows
    too_big = GemmConfig(256, 256, 128, 4, 256, 0)  # ~0.5 MB of shared memory: pruned before compiling
    calls = []

    def fake_measure(kernel, cfg):
        calls.append(cfg)
        assert kernel.meta.arch == "sm_90a" and kernel.cubin
        if cfg == wrong:
            raise bench.WrongResult("relative error 1.0e+00 vs the float32 reference (tolerance 0.005)")
        if cfg == crashes:
            raise RuntimeError("tile_ops: CUDA error CUDA_ERROR_LAUNCH_FAILED")
        return 1.0 if cfg == fast else 2.0

    result = autotune.tune("gemm", shape, "float16", configs=[fast, wrong, crashes, untileable, too_big],
                           arch="sm_90a", measure=fake_measure, gpu=FAKE_GPU, show_progress=False)
    reasons = {c.config: c.skipped for c in result.candidates}
    assert reasons[too_big].startswith("shared memory: needs ~")
    assert reasons[untileable].startswith("compile error: TileLangError") and "cannot be tiled" in reasons[untileable]
    assert reasons[wrong].startswith("wrong result: relative error")
    assert reasons[crashes].startswith("launch error: RuntimeError: tile_ops: CUDA error")
    assert too_big not in calls and untileable not in calls
    default = gemm_defaults.default_config(*shape)
    assert set(calls) == {fast, wrong, crashes, default} and result.default_ms == 2.0
    assert result.best.config == fast and result.best.ms == 1.0
    assert result.key == f"{FAKE_GPU}|gemm|float16|128x128x64|sm_90a"
    assert autotune.config_for("gemm", 128, 128, 64, "float16") == fast  # the in-process memo was refreshed
    entry = autotune.TuneTable().entries()[result.key]
    assert entry["candidates"] == 6 and entry["skipped"] == 4 and entry["arch"] == "sm_90a"

    def context_lost(kernel, cfg):
        raise bench.DeviceLost("the CUDA context is unusable")

    with pytest.raises(bench.DeviceLost):  # not skipped like a failed candidate: every later one would fail too
        autotune.tune("gemm", shape, configs=[fast], arch="sm_90a", measure=context_lost, gpu=FAKE_GPU,
                      show_progress=False)


def _fake_compile(monkeypatch, archs=None, store=None):
    """GemmTarget.compile without nvcc: records the arch, optionally stores an entry (what the jit does)."""

    def compile(self, shape, dtype, cfg, arch):
        if archs is not None:
            archs.append(arch)
        if store is not None:
            store()
        return types.SimpleNamespace(meta=types.SimpleNamespace(smem_bytes=0))

    monkeypatch.setattr(GemmTarget, "compile", compile)


def test_tune_on_a_device_compiles_for_that_devices_arch(monkeypatch):
    """tune(device="cuda:1") compiled for the current device's arch (cuda:0, an H100 here) and timed on an A100."""
    archs = []
    _fake_compile(monkeypatch, archs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability",  # cuda:1 an A100, the current device an H100
                        lambda device=None: (8, 0) if device is not None and torch.device(device).index == 1
                        else (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(shared_memory_per_block_optin=166912))
    monkeypatch.setattr(bench, "GpuBench", lambda target, shape, dtype, device: lambda kernel, cfg: 1.0)
    result = autotune.tune("gemm", (64, 64, 64), configs=[], device="cuda:1", gpu=FAKE_GPU, save=False,
                           show_progress=False)
    assert result.arch == "sm_80" and archs == ["sm_80"]


def test_a_failed_table_write_prints_the_results_and_says_why(fake_gpu, monkeypatch, capsys):
    """After all the timing, the write failed with a bare OSError: the results were lost."""
    from tile_ops.__main__ import main
    from tile_ops.autotune import cli

    _fake_compile(monkeypatch)
    monkeypatch.setattr(table.TuneTable, "_publish",
                        lambda self, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OSError, match=r"could not write the autotune table .*No space left on device.*the best "
                                      r"config, printed above, was not recorded"):
        autotune.tune("gemm", (64, 64, 64), configs=[], arch="sm_90a", measure=lambda kernel, cfg: 1.0, gpu=FAKE_GPU,
                      show_progress=False)
    default = gemm_defaults.default_config(64, 64, 64, "sm_90a")
    assert f"best of gemm 64x64x64 float16 on {FAKE_GPU} (sm_90a): {default}, 1.0000 ms" in capsys.readouterr().err

    def tune_that_cannot_record(*args, **kwargs):
        raise table.TableWriteError("tile_ops: could not write the autotune table T: [Errno 28] No space left")

    monkeypatch.setattr(autotune, "tune", tune_that_cannot_record)
    monkeypatch.setattr(cli, "_gpu_available", lambda: True)
    assert main(["tune", "gemm", "--shape", "64x64x64", "--quiet"]) == 1
    assert "error: could not write the autotune table T: [Errno 28] No space left" in capsys.readouterr().err


def test_tune_compile_only_says_when_its_kernels_were_not_stored(tmp_path, monkeypatch, capsys):
    """It reported the candidates built and exited 0 while a full disk kept every one out of the cache."""
    from tile_ops.__main__ import main
    from tile_ops.jit.cache import CacheEntry, DiskCache

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "tmp").write_text("")  # where stores make their temp dirs: every store fails
    _fake_compile(monkeypatch, store=lambda: DiskCache().store("ab" * 16, CacheEntry("// src", b"cubin")))
    monkeypatch.setattr(GemmTarget, "config_space", lambda self, shape, dtype, arch: [])
    with pytest.warns(UserWarning, match="could not store kernel"):
        assert main(["tune", "gemm", "--shape", "64x64x64", "--compile-only", "--quiet", "--arch", "sm_90a"]) == 1
    assert "1 kernel(s) built but NOT stored in the kernel cache ([Errno 17] File exists" in capsys.readouterr().err


def test_tune_without_a_gpu_or_timer_says_how_to_proceed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU.*compile_only=True"):
        autotune.tune("gemm", (64, 64, 64), configs=[], show_progress=False)
    with pytest.raises(ValueError, match="unknown op 'conv'.*gemm, gemm_softmax"):
        autotune.tune("conv", (64, 64, 64))


def test_progress_fallback_prints_plain_lines(capsys):
    bar = _Bar(20, "compile", sys.stderr)
    for _ in range(20):
        bar.update()
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "compile: 1/20" and lines[-1] == "compile: 20/20" and len(lines) <= 11


def test_input_copies_cover_twice_the_l2():
    l2 = 50 << 20
    assert bench.input_copies(96 << 20, l2) == 2  # 4096^3 fp16: one set already exceeds L2
    assert bench.input_copies(1 << 20, l2) == 100
    assert bench.input_copies(1 << 10, l2) == bench.MAX_COPIES


# ---------------------------------------------------------------------------------------------- CLI
def test_cli_tune_is_a_tile_ops_command():
    proc = subprocess.run([sys.executable, "-m", "tile_ops", "tune", "--help"], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    assert proc.returncode == 0 and "--shape" in proc.stdout and "--list" in proc.stdout, proc.stderr


def test_cli_show_clear_and_no_gpu(capsys, monkeypatch):
    from tile_ops.__main__ import main
    from tile_ops.autotune import cli

    autotune.record("gemm", (4096, 4096, 4096), "float16", FAKE_GPU, GemmConfig(), ms=0.25, default_ms=0.3)
    assert main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert str(autotune.table_path()) in out and "(1 entry)" in out
    row = next(line for line in out.splitlines() if line.startswith(FAKE_GPU))
    assert "4096x4096x4096" in row and "block_M=128" in row and "1.20x" in row

    monkeypatch.setattr(cli, "_gpu_available", lambda: False)
    assert main(["tune", "gemm", "--shape", "64x64x64"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "--compile-only" in err

    assert main(["tune", "--clear"]) == 0
    assert "removed 1 tuned entry" in capsys.readouterr().out
    assert autotune.TuneTable().entries() == {}


def test_cli_list_and_bad_input(capsys):
    from tile_ops.__main__ import main

    assert main(["tune", "--list"]) == 0
    out = capsys.readouterr().out
    assert "gemm: tile_ops.kernels.gemm_config.GemmConfig(block_M=" in out and "gemm_softmax:" in out

    assert main(["tune", "--list", "gemm", "--shape", "4096x4096x4096", "--arch", "sm_86"]) == 0
    out = capsys.readouterr().out
    assert "candidates for 4096x4096x4096 float16 on sm_86" in out and "shared memory: needs ~" in out
    assert "default" in out

    for argv, message in [(["tune"], "give an op and --shape"), (["tune", "gemm"], "give an op and --shape"),
                          (["tune", "gemm", "--shape", "64x64"], "expected a shape MxNxK"),
                          (["tune", "conv", "--shape", "64x64x64"], "invalid choice: 'conv'"),
                          (["tune", "gemm", "--shape", "64x64x64", "-j", "0"], "a number of threads, at least 1"),
                          (["tune", "--list", "--shape", "64x64x64"], "--list --shape needs an op")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err, argv


def test_attention_launches_the_tuned_config_for_its_head_dim_and_heads(fake_gpu, monkeypatch):
    """A tuned (seqlen, heads, head dim) serves lengths in its bucket at that head count and head dim, every mask
    kind; others launch the default."""
    from tile_ops.kernels import attention_config, attention_launch

    seen = []

    def build(problem, cfg=None, arch=None):
        seen.append(cfg)
        raise StopIteration  # the config is all this test needs

    monkeypatch.setattr(attention_launch, "build_attention", build)
    tuned = attention_config.AttentionConfig(64, 80, 2, 128)
    autotune.record("flash_attention", (1024, 8, 64), "float16", FAKE_GPU, tuned, arch="sm_90a")
    for S, H, causal, want in ((700, 8, False, tuned), (1000, 8, True, tuned), (1000, 4, False, None),
                               (2000, 8, False, None)):
        q = torch.empty(1, S, H, 64, dtype=torch.float16)
        with pytest.raises(StopIteration):
            attention_launch.launch_attention(q, q, q, q, torch.empty(1, H, S), causal=causal, arch="sm_90a")
        assert seen[-1] == (want or attention_config.default_config(64, "sm_90a")), (S, H)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("op, shape, configs", [
    ("gemm", (256, 192, 128), [GemmConfig(64, 64, 32, 3, 128, 0), GemmConfig(128, 64, 64, 2, 128, 0)]),
    ("gemm_softmax", (200, 96, 64), [SoftmaxConfig(64, 64, 32, 3, 128, "full_row"),
                                      SoftmaxConfig(128, 128, 32, 2, 256)]),
    ("flash_attention", (300, 4, 64), [AttentionConfig(64, 64, 2, 128), AttentionConfig(128, 80, 3, 256, 2)]),
])
def test_tune_end_to_end_on_the_gpu(op, shape, configs):
    result = autotune.tune(op, shape, "float16", configs=configs, show_progress=False)
    assert all(c.skipped is None and c.ms > 0 for c in result.candidates), [c.skipped for c in result.candidates]
    assert result.key and autotune.TuneTable().entries()[result.key]["gpu"] == torch.cuda.get_device_name()
    assert autotune.config_for(op, *shape, "float16", torch.device("cuda")) == result.best.config
    import tile_ops

    if op == "flash_attention":  # the op launches the tuned config
        from tile_ops.ops.attention import attention_reference

        q, k, v = (torch.randn(2, shape[0], shape[1], shape[2], dtype=torch.float16, device="cuda") for _ in range(3))
        got, ref = tile_ops.flash_attn_func(q, k, v), attention_reference(q.double(), k.double(), v.double())
        assert ((got.double() - ref).norm() / ref.norm()).item() < 5e-3
        return
    M, N, K = shape
    a = torch.randn(M, K, dtype=torch.float16, device="cuda")
    b = torch.randn(K, N, dtype=torch.float16, device="cuda") * K ** -0.5
    if op == "gemm":
        got, ref = tile_ops.gemm(a, b), a.double() @ b.double()
    else:
        got, ref = tile_ops.gemm_softmax(a, b), torch.softmax(a.double() @ b.double(), -1)
    assert ((got.double() - ref).norm() / ref.norm()).item() < 5e-3


def test_a_scale_that_changes_every_call_is_called_out_once(monkeypatch):
    """Each scale compiles its own kernel (a constant of it): a learnable temperature would compile every step."""
    monkeypatch.setattr(softmax_launch, "gemm_softmax", lambda *args, **kw: None)
    monkeypatch.setattr(softmax_launch, "_SCALES_SEEN", {})
    a, b = torch.randn(128, 64, dtype=torch.float16), torch.randn(64, 96, dtype=torch.float16)
    out = torch.empty(128, 96, dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):  # one scale, however often: silent
            softmax_launch.get_gemm_softmax_kernel(a, b, out, 0.125)
        for i in range(softmax_launch.MANY_SCALES - 2):
            softmax_launch.get_gemm_softmax_kernel(a, b, out, 1.0 + i)
    with pytest.warns(UserWarning, match=r"8 different scales for one problem \(N, K\) = \(96, 64\).*multiply a"):
        softmax_launch.get_gemm_softmax_kernel(a, b, out, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        softmax_launch.get_gemm_softmax_kernel(a, b, out, 0.25)  # said once
