"""The ``tile_ops`` command line (tile_ops/__main__.py): cache info/clear, precompile, demo --quick.

Every command runs in a subprocess (``python -m tile_ops``) with TILE_OPS_CACHE_DIR in tmp_path and
CUDA_VISIBLE_DEVICES="" so the no-GPU path is taken even on a GPU machine.  Needs nvcc (CPU only).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import threading

import pytest

from tile_ops.__main__ import Job, main, parse_arch, parse_shape
from tile_ops.jit.cache import CacheEntry, DiskCache


def run_cli(cache, *args, env=None, timeout=240):
    full_env = dict(os.environ, TILE_OPS_CACHE_DIR=str(cache), CUDA_VISIBLE_DEVICES="", **(env or {}))
    proc = subprocess.run([sys.executable, "-m", "tile_ops", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)
    assert proc.returncode == 0, f"tile_ops {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def entries(cache) -> int:
    return DiskCache(cache).info()["entries"]


def _have_cuobjdump() -> bool:
    from tile_ops.jit.build import _find_tool

    return _find_tool("cuobjdump", "TILE_OPS_CUOBJDUMP") is not None


def test_cache_info_and_clear_on_empty_cache(tmp_path):
    cache = tmp_path / "cache"
    out = run_cli(cache, "cache", "info")
    assert str(cache) in out
    assert re.search(r"entries:\s+0\b", out)
    assert re.search(r"size:\s+0\.00 MB", out)
    assert "removed 0 entries" in run_cli(cache, "cache", "clear")


def test_cache_clear_removes_an_entry_holding_a_stray_file(tmp_path, monkeypatch, capsys):
    """It said "removed 0 entries" and the entry was still served."""
    key, cache = "ab" + "0" * 30, DiskCache(tmp_path / "cache")
    cache.store(key, CacheEntry("// source", b"cubin", {"kernel": "k"}))
    (cache.path(key) / "kernel.cubin.orig").write_bytes(b"a copy made while debugging")
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(cache.root))
    assert main(["cache", "clear"]) == 0
    assert "removed 1 entry" in capsys.readouterr().out
    assert cache.load(key) is None


@pytest.mark.parametrize("action", ["info", "clear"])
def test_a_cache_path_that_is_a_file_is_an_error(tmp_path, monkeypatch, capsys, action):
    """It read as an empty cache (and `clear` "removed 0 entries"); a build then failed on <file>/locks."""
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("")
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(not_a_dir))
    assert main(["cache", action]) == 2
    assert f"the kernel cache {not_a_dir} (TILE_OPS_CACHE_DIR) is not a directory" in capsys.readouterr().err
    with pytest.raises(NotADirectoryError, match="accepted: a directory"):
        DiskCache()


@pytest.mark.parametrize("ancestor", [False, True])
def test_a_cache_path_that_is_a_dangling_link_is_an_error(tmp_path, monkeypatch, capsys, ancestor):
    """A link to an unmounted volume: `cache info` read it as empty, every build failed with FileExistsError and
    `tune --clear` printed a traceback."""
    link = tmp_path / "cache"
    link.symlink_to(tmp_path / "not-mounted" / "cache")
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(link / "sub" if ancestor else link))
    for argv in (["cache", "info"], ["cache", "clear"], ["tune", "--clear"], ["tune", "--show"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"{link}{'' if ancestor else ' (TILE_OPS_CACHE_DIR)'} is a symbolic link to " \
               f"{tmp_path / 'not-mounted' / 'cache'}, which does not exist" in err, argv
        assert "accepted: a directory, or a path that does not exist yet" in err and "Traceback" not in err
    with pytest.raises(NotADirectoryError, match="which does not exist"):
        DiskCache()


def test_an_a_suffix_is_accepted_on_sm_90_only(capsys):
    """sm_80a was accepted, then nvcc failed on every kernel ("Unsupported gpu architecture 'compute_80a'")."""
    for arch in ("sm_80a", "sm_86a", "sm_89a", "sm_100a"):
        with pytest.raises(SystemExit) as e:
            main(["precompile", "--arch", arch, "--gemm", "8x8x8"])
        assert e.value.code == 2
        assert f"target arch '{arch}' is not one the compiler builds for" in capsys.readouterr().err
    for arch in ("sm_80", "sm_90", "sm_90a", "sm_100"):
        assert parse_arch(arch) == arch


def test_precompile_says_when_a_kernel_was_not_stored(tmp_path):
    """A full disk (here: no temp dir can be made in the cache): it reported "built" and exited 0."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tmp").write_text("")
    proc = subprocess.run([sys.executable, "-m", "tile_ops", "precompile", "--arch", "sm_80", "--gemm", "128x128x64",
                           "--dtype", "float16"], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, TILE_OPS_CACHE_DIR=str(cache), CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("gemm 128x128x64"))
    assert "built, NOT stored" in row and "File exists" in row, proc.stdout
    assert "0 built, 0 already cached, 0 failed, 1 built but NOT stored in the cache" in proc.stdout
    assert entries(cache) == 0


def test_precompile_fills_cache_then_hits_it(tmp_path):
    cache = tmp_path / "cache"
    assert entries(cache) == 0
    out = run_cli(cache, "precompile", "--arch", "sm_80", "--gemm", "128x128x64", "128x128x64", "--dtype", "float16")
    assert "gemm 128x128x64 float16" in out and "built" in out, out
    assert "1 built, 0 already cached, 0 failed" in out  # a shape given twice is one kernel
    key = re.search(r"\b([0-9a-f]{32})\b", out).group(1)
    assert (cache / key[:2] / key / "kernel.cubin").is_file()
    assert entries(cache) == 1

    out = run_cli(cache, "precompile", "--arch", "sm_80", "--gemm", "128x128x64", "--dtype", "float16")
    assert "0 built, 1 already cached" in out, out
    row = next(line for line in out.splitlines() if key in line)
    assert "cached" in row
    assert float(row.split()[-1]) < 1.0, row  # a disk hit: no trace, no lowering, no nvcc
    out = run_cli(cache, "cache", "info")
    assert re.search(r"entries:\s+1\b", out) and not re.search(r"size:\s+0\.00 MB", out), out

    assert "removed 1 entry" in run_cli(cache, "cache", "clear")
    assert entries(cache) == 0


def _stand_in_kernel(source):
    from tile_ops.compiler.meta import KernelMeta
    from tile_ops.jit.kernel import Kernel

    meta = KernelMeta(name="k", entry="k_kernel", arch="sm_90a", grid=(1, 1, 1), block=(128, 1, 1), smem_bytes=0,
                      params=[("A", (64,), "float16"), ("C", (64,), "float16")], kept=["A", "C"], out_idx=[1],
                      resources={}, layouts={}, tensormaps={})
    return Kernel(meta, source, b"cubin")


def test_precompile_counts_a_kernel_another_process_built_while_it_waited_as_cached(tmp_path, monkeypatch, capsys):
    """Two precompiles at once: the one that waited for a key's lock loaded what the other built, and reported it
    "built" (19 "built" for 8 compiles)."""
    jit = sys.modules["tile_ops.jit"]
    ours, theirs = "aa" + "0" * 30, "bb" + "0" * 30
    cache = DiskCache(tmp_path / "cache")
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(cache.root))
    monkeypatch.setattr(jit, "_build", lambda prog, target, out_idx: (_stand_in_kernel("// built here"), {}))
    keys = {(64, 64, 64): ours, (128, 64, 64): theirs}
    monkeypatch.setattr(Job, "key_and_builder", lambda job: (
        keys[job.shape], lambda: jit._load_or_build(keys[job.shape], lambda: "program", "sm_90a", [1])))
    waiting, real_lock = threading.Event(), DiskCache.lock

    def lock(self, key, **kw):
        if key == theirs:
            waiting.set()
        return real_lock(self, key, **kw)

    with cache.lock(theirs):  # the other process, compiling `theirs`
        monkeypatch.setattr(DiskCache, "lock", lock)
        done = []
        run = threading.Thread(target=lambda: done.append(main(["precompile", "--arch", "sm_90a", "--gemm",
                                                                "64x64x64", "128x64x64", "--dtype", "float16"])))
        run.start()
        assert waiting.wait(60)  # our precompile missed `theirs` and waits for its lock
        kernel = _stand_in_kernel("// built by the other process")
        cache.store(theirs, CacheEntry(kernel.source, kernel.cubin, kernel.meta.to_json()))
    run.join(60)
    out = capsys.readouterr().out
    assert done == [0], out
    assert re.search(rf"{ours}\s+built\s+\d", out) and re.search(rf"{theirs}\s+cached\s+\d", out), out
    assert "1 built, 1 already cached, 0 failed" in out, out


def test_precompile_builds_what_the_op_launches_for_unaligned_rows(tmp_path):
    """sm_90a, rows of 1001 halves (K) and 999 (N): the gemm over padded rows (the key reported is its own)
    and the two pad_rows kernels go into the cache, as the op path builds them."""
    cache = tmp_path / "cache"
    out = run_cli(cache, "precompile", "--arch", "sm_90a", "--gemm", "256x999x1001", "--dtype", "float16")
    assert "1 built, 0 already cached, 0 failed" in out, out
    key = re.search(r"\b([0-9a-f]{32})\b", out).group(1)
    params = json.loads((cache / key[:2] / key / "meta.json").read_text())["meta"]["params"]
    assert [p[:2] for p in params[:2]] == [["A", [1, "M", 1008]], ["B", [1, 1001, 1000]]], params  # M at run time
    assert entries(cache) == 3  # the gemm and a pad_rows kernel per operand


MODEL = """
import torch, tile_ops.nn

def make():
    model = torch.nn.Sequential(tile_ops.nn.Linear(256, 512), torch.nn.GELU(), tile_ops.nn.Linear(512, 128, bias=False))
    return model.half(), (torch.randn(3, 100, 256, dtype=torch.float16),)
"""


def _problems_launched_by(cache, script) -> list:
    """The kernel problems a CPU run of ``script`` recorded (TILE_OPS_RECORD)."""
    record = cache.parent / "record.jsonl"
    env = dict(os.environ, TILE_OPS_RECORD=str(record), CUDA_VISIBLE_DEVICES="")
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    return [json.loads(line) for line in record.read_text().splitlines()], record


def test_precompile_builds_what_a_recorded_run_launches(tmp_path):
    """A model run on the CPU with TILE_OPS_RECORD lists its gemm problems (nn.Linear: B is the transposed
    weight, a bias in the first); precompile --record builds the kernels the op launches for them: their keys
    are the op path's own."""
    cache = tmp_path / "cache"
    (tmp_path / "model.py").write_text(MODEL)
    script = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import model; m, x = model.make(); m(*x); m(*x)"
    entries_, record = _problems_launched_by(cache, script)
    assert [(e["op"], e["problem"]["M"], e["problem"]["N"], e["problem"]["trans_B"], e["problem"]["has_bias"])
            for e in entries_] == [("gemm", 300, 512, True, True), ("gemm", 300, 128, True, False)]
    out = run_cli(cache, "precompile", "--arch", "sm_90a", "--record", str(record))
    assert "2 built, 0 already cached, 0 failed" in out, out
    from tile_ops.autotune import targets

    for e in entries_:
        key, _ = targets.get("gemm").launched(e["problem"], "sm_90a")
        assert (cache / key[:2] / key / "kernel.cubin").is_file()
    out = run_cli(cache, "precompile", "--arch", "sm_90a", "--module", f"{tmp_path / 'model.py'}:make")
    assert "0 built, 2 already cached" in out, out  # the model's forward, traced here: the same two problems


def test_precompile_every_m_builds_a_kernel_per_config_not_per_m(tmp_path):
    """--all-m: the kernels of every token count up to MAX, each built once (the kernels take M at run time)."""
    cache = tmp_path / "cache"
    out = run_cli(cache, "precompile", "--arch", "sm_90a", "--gemm", "64x4096x4096", "--dtype", "float16",
                  "--all-m", "2048", timeout=600)
    keys = re.findall(r"\b([0-9a-f]{32})\b", out)
    assert 1 < len(keys) == len(set(keys)) == int(re.search(r"(\d+) built", out).group(1)) < 16, out
    assert all((cache / k[:2] / k / "kernel.cubin").is_file() for k in keys)
    assert entries(cache) < 2 * len(keys)  # and a split-K config's reduction kernel


def test_a_malformed_recording_is_refused_by_line(tmp_path):
    record = tmp_path / "record.jsonl"
    record.write_text('{"op": "gemm", "problem": {"M": 1}}\nnot json\n')
    proc = subprocess.run([sys.executable, "-m", "tile_ops", "precompile", "--arch", "sm_90a", "--record", str(record)],
                          capture_output=True, text=True, env=dict(os.environ, TILE_OPS_CACHE_DIR=str(tmp_path / "c")))
    assert proc.returncode != 0 and f"{record}:2: not a TILE_OPS_RECORD line" in proc.stderr, proc.stderr


def test_demo_quick_without_gpu(tmp_path):
    cache = tmp_path / "cache"
    out = run_cli(cache, "demo", "--quick", "--arch", "sm_90a")
    assert "No CUDA GPU found" in out and "sm_90a" in out
    assert str(cache) in out
    rows = [line for line in out.splitlines() if line.startswith(("gemm ", "gemm_softmax "))]
    assert len(rows) == 3, out
    assert all("ERROR" not in r for r in rows), out
    attention = [line for line in out.splitlines() if line.startswith("flash_attention ")]
    assert len(attention) == 1 and "ERROR" not in attention[0] and "256x4x64" in attention[0], out
    header = next(line for line in out.splitlines() if line.startswith("kernel "))
    for col in ("regs", "spills", "smem_bytes", "HMMA", "HGMMA", "LDSM", "LDGSTS", "UTMALDG", "SHFL", "BAR"):
        assert col in header.split()
    if _have_cuobjdump():
        hgmma = header.split().index("HGMMA")
        assert all(int(r.split()[hgmma]) > 0 for r in rows), out  # the Hopper path: wgmma in the SASS

    # second run: every kernel is a cache hit; without cuobjdump the mix reads n/a instead of failing
    out = run_cli(cache, "demo", "--quick", "--arch", "sm_90a", env={"TILE_OPS_CUOBJDUMP": str(tmp_path / "none")})
    rows = [line for line in out.splitlines() if line.startswith(("gemm ", "gemm_softmax "))]
    assert len(rows) == 3 and all("cached" in r and "n/a" in r for r in rows), out


def test_argument_errors():
    assert parse_shape("4096x1024x64") == (4096, 1024, 64)
    for bad in (["precompile", "--arch", "sm_80", "--gemm", "12x3"], ["precompile", "--gemm", "8x8x8"],
                ["cache", "list"], [], ["precompile", "--arch", "hopper", "--gemm", "8x8x8"],
                ["precompile", "--arch", "sm_75", "--gemm", "8x8x8"], ["precompile", "--arch", "sm_90a", "-j", "-1"],
                ["tune", "gemm", "--shape", "64x64x64", "--arch", "sm_"], ["tune", "--list", "gemm", "-j", "0"],
                ["demo", "--arch", "90"], ["precompile", "--arch", "sm_80", "--scale", "nan"],
                ["precompile", "--arch", "sm_80", "--scale", "inf"]):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2, bad


def test_show_skips_a_malformed_entry(tmp_path, monkeypatch, capsys):
    from tile_ops import autotune

    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path))
    autotune.TuneTable().update({"garbage": "garbage"})
    with pytest.warns(UserWarning, match=r"ignoring 1 malformed entry of the autotune table .*'garbage' \(not an "
                                         r"object\)"):
        assert main(["tune", "--show"]) == 0
    assert "(0 entries)" in capsys.readouterr().out


def test_list_shows_every_dtype_asked_for(capsys):
    assert main(["tune", "--list", "gemm", "--shape", "64x64x64", "--dtype", "float16", "bfloat16",
                 "--arch", "sm_80"]) == 0
    out = capsys.readouterr().out
    assert "candidates for 64x64x64 float16 on sm_80" in out and "candidates for 64x64x64 bfloat16 on sm_80" in out


def test_show_and_clear_refuse_an_op_or_shape(tmp_path, monkeypatch, capsys):
    """They cover the whole table: `tune --clear gemm` must not clear gemm_softmax's entries."""
    from tile_ops import autotune

    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path))
    from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig

    autotune.record("gemm_softmax", (8, 8, 8), "float16", "gpu", SoftmaxConfig(64, 64, 32, 3, 128, "full_row"))
    for bad in (["tune", "--clear", "gemm"], ["tune", "--show", "--shape", "8x8x8"]):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2
        assert f"{bad[1]} covers the whole tuned table: it takes no op or --shape" in capsys.readouterr().err
    assert len(autotune.TuneTable().entries()) == 1


@pytest.mark.skipif(shutil.which("tile_ops") is None, reason="console script not installed")
def test_console_script(tmp_path):
    proc = subprocess.run(["tile_ops", "cache", "info"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TILE_OPS_CACHE_DIR=str(tmp_path)))
    assert proc.returncode == 0 and str(tmp_path) in proc.stdout, proc.stderr



def test_precompile_builds_attention_kernels_for_every_length(tmp_path):
    """--flash-attention SxHxD: what a training step at head dim D launches, causal and not, on padded and packed
    sequences: the forward, Delta (one for all), the key-block kernel and (at D64) the dQ kernel, 13 in all; a
    recorded run's attention calls (any lengths, scales) name the same forward kernels, whose keys are the op
    path's own."""
    cache = tmp_path / "cache"
    out = run_cli(cache, "precompile", "--arch", "sm_90a", "--flash-attention", "1024x8x64", "--dtype", "float16")
    for kind in ("", " causal", " varlen", " causal varlen"):
        assert f"flash_attention d64 float16{kind} " in out, out
    assert "4 built, 0 already cached, 0 failed" in out, out
    assert "entries: 13" in run_cli(cache, "cache", "info"), out
    script = ("import torch, tile_ops; q = torch.randn(2, 33, 4, 64).half(); k = torch.randn(2, 70, 2, 64).half(); "
              "tile_ops.flash_attn_func(q, k, k, causal=True); "
              "tile_ops.flash_attn_func(q[:, :5], k, k, causal=True, softmax_scale=0.3)")
    entries_, record = _problems_launched_by(cache, script)
    assert entries_ == [{"op": "flash_attention", "problem": {"dim": 64, "dtype": "float16", "causal": True,
                                                              "local": False, "softcap": False, "alibi": False,
                                                              "varlen": False}}]
    out = run_cli(cache, "precompile", "--arch", "sm_90a", "--record", str(record))
    assert "0 built, 1 already cached" in out, out
