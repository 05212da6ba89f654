"""The benchmarks' CPU-side pieces: JSON and PNG output (with and without matplotlib), the CPU
host-overhead profile (benchmarks/host_overhead_cpu.py) end to end, and the sanitizer runner
(benchmarks/sanitize.py): its --dry-run and how it reads compute-sanitizer's summaries."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402

from tile_ops.jit.build import _find_tool  # noqa: E402

ROWS = [{"dtype": dt, "shape": s, "tile_ops": t, "cuBLAS": c, "triton": tr}
        for dt in ("float16", "bfloat16")
        for s, t, c, tr in (("4096x4096x4096", 610.2, 720.5, 650.0), ("64x4096x4096", 90.0, 120.0, None))]


def test_png_without_matplotlib_says_so_and_is_skipped(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    png = common.png_path_or_none(str(tmp_path / "out.png"))
    assert png is None
    assert "matplotlib is not installed, so no plot will be written" in capsys.readouterr().err
    common.save(ROWS, str(tmp_path / "out.json"), png, ys=("tile_ops", "cuBLAS"))
    assert not (tmp_path / "out.png").exists()
    assert json.loads((tmp_path / "out.json").read_text())["rows"] == ROWS
    assert common.png_path_or_none(None) is None


def test_png_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    png = common.png_path_or_none(str(tmp_path / "out.png"))
    common.save(ROWS, None, png, x=("dtype", "shape"), ys=("tile_ops", "cuBLAS", "triton"), ylabel="TFLOP/s")
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_host_overhead_cpu_runs(tmp_path):
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "host_overhead_cpu.py"), "--iters", "20", "--repeat", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["path"]: r["us_per_call"] for r in json.loads(out.read_text())["rows"]}
    assert rows["tile_ops.gemm (fast path)"] > 0 and rows["torch.ops.tile_ops.gemm (dispatcher + plan)"] > 0


def _sanitize():
    import importlib

    return importlib.import_module("sanitize")


def test_sanitize_child_checks_a_shape_outside_its_table():
    """``sanitize.py --child gemm ARCH M N K LABEL`` on a shape with no entry in SHAPES (a bisection by hand):
    the reference comes from the shape it was given (it looked the label up, and a KeyError after the
    launch left the run unchecked)."""
    san = _sanitize()
    shape = (72, 136, 40)
    assert "bisect" not in dict(san.SHAPES["gemm"])
    k = san.build("gemm", "sm_90a", shape, "bisect")
    tensors = san.make_tensors(k, seed=0, M=shape[0])
    pos, ref = san.reference("gemm", tensors, "bisect", shape)
    assert pos == san.out_position(k) and tuple(ref.shape) == (1, 72, 136)
    assert san.check("gemm", tensors, ref.to(tensors[pos].dtype), "bisect", shape)[0]
    assert not san.check("gemm", tensors, tensors[pos], "bisect", shape)[0]  # the NaN-filled output fails


def test_sanitize_wrap_shapes_take_more_k_steps_than_stages_and_the_short_walk_fewer():
    """The labels say what the sanitizers cover, so they must stay true as defaults change: the clustered
    ``*-wrap`` shapes wait on released stages (k-steps > stages), ``short-grid-lines`` does unclustered,
    ``short-grid-swapped`` runs the swapped 2x4 clusters past their stages,
    ``cluster-walk-1k`` never does."""
    from tile_ops.kernels import gemm_softmax_defaults
    from tile_ops.kernels.gemm_defaults import default_config
    from tile_ops.kernels.gemm_softmax_config import block_columns

    san = _sanitize()
    shapes = {**{("gemm", lb): s for lb, s in san.SHAPES["gemm"]},
              **{("gemm_softmax", lb): s for lb, s in san.SHAPES["gemm_softmax"]}}

    def config(kernel, label):
        cfg = (default_config if kernel == "gemm" else gemm_softmax_defaults.default_config)(*shapes[kernel, label],
                                                                                             "sm_90a")
        k_steps = -(-shapes[kernel, label][2] // cfg.block_K)
        return cfg, k_steps

    for kernel, label in (("gemm", "short-grid-wrap"), ("gemm", "short-grid-long-k"), ("gemm_softmax", "cluster-wrap")):
        cfg, k_steps = config(kernel, label)
        assert (cfg.cluster if kernel == "gemm" else cfg.split) > 1 and k_steps > cfg.num_stages, (label, cfg)
    assert {config("gemm", lb)[0].block_K for lb in ("short-grid-wrap", "short-grid-long-k")} == {64, 128}  # both depths
    cfg, k_steps = config("gemm", "short-grid-lines")
    assert cfg.cluster == cfg.cluster_n == 1 and cfg.block_M == 64 and k_steps > cfg.num_stages, cfg
    cfg, k_steps = config("gemm", "short-grid-swapped")
    assert cfg.swap_ab and cfg.cluster_n > 1 and k_steps > cfg.num_stages, cfg
    cfg, k_steps = config("gemm_softmax", "cluster-walk-1k")
    tiles = block_columns(shapes["gemm_softmax", "cluster-walk-1k"][1], cfg) // cfg.block_N
    assert tiles > 1 and k_steps * tiles <= cfg.num_stages, cfg  # each block walks, its pipeline never wraps


def test_sanitize_shapes_picks_runs_by_label():
    """--shapes cluster-walk: only that shape's runs (the one that needs a longer --timeout)."""
    san = _sanitize()
    runs = san.plan(["gemm", "gemm_softmax"], ["sm_90a"], ["racecheck"], ["cluster-walk"])
    assert [(k, label, tool) for k, _, label, _, tool in runs] == [("gemm_softmax", "cluster-walk", "racecheck")]
    assert len(san.plan(["gemm"], ["sm_90a"], ["racecheck"])) == len(san.SHAPES["gemm"])


def test_sanitize_dry_run_builds_everything_and_lists_the_runs(tmp_path):
    """benchmarks/sanitize.py --dry-run: every kernel x path x shape compiles for sm_90a and sm_90 (in a fresh
    cache, without a GPU), the child's CPU half (inputs, float64 reference, check) works, and every planned
    sanitizer run is listed."""
    from tile_ops.jit.build import _find_tool

    if _find_tool("nvcc", "TILE_OPS_NVCC") is None:
        pytest.skip("nvcc not installed")
    san = _sanitize()
    env = dict(os.environ, TILE_OPS_CACHE_DIR=str(tmp_path / "cache"), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "sanitize.py"), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n_builds = sum(len(s) for s in san.SHAPES.values()) * len(san.PATHS)
    assert f"built {n_builds}/{n_builds} kernels" in proc.stdout, proc.stdout
    n_runs = n_builds * len(san.DEFAULT_TOOLS)
    assert f"{n_runs} runs planned" in proc.stdout, proc.stdout
    commands = [line for line in proc.stdout.splitlines() if "--child" in line]
    assert len(commands) == n_runs
    for tool in san.DEFAULT_TOOLS:
        assert sum(f"--tool {tool} " in c for c in commands) == n_builds
    assert all("--error-exitcode 1" in c for c in commands)
    # the sm_90a path takes TMA on the aligned shapes and falls back on the unaligned ragged one
    tma = {tuple(line.split()[:3]): line.rstrip().endswith("tma=yes") for line in proc.stdout.splitlines()
           if "<tile_ops.Kernel" in line}
    assert tma[("gemm", "sm_90a", "ragged-tma")] and tma[("matmul20", "sm_90a", "small")]
    assert not tma[("gemm", "sm_90a", "ragged")] and not any(v for k, v in tma.items() if k[1] == "sm_90")


@pytest.mark.parametrize("text, rc, timed_out, result, clean", [
    ("sanitize child: ... ok\n========= ERROR SUMMARY: 0 errors\n", 0, False, "clean", True),
    ("========= Invalid __global__ read of size 16 bytes\n========= ERROR SUMMARY: 3 errors\n", 1, False,
     "3 errors", False),
    ("========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n", 1, False, "1 errors, 1 warnings",
     False),
    ("========= RACECHECK SUMMARY: 1 hazard displayed (0 errors, 1 warning)\n", 0, False, "0 errors, 1 warnings",
     False),
    ("sanitize child: ... WRONG RESULT\n========= ERROR SUMMARY: 0 errors\n", 3, False, "wrong result", False),
    ("Traceback ...\nRuntimeError: boom\n========= ERROR SUMMARY: 0 errors\n", 1, False, "failed rc=1", False),
    ("sanitize child: ... ok\n", 0, False, "no summary", False),
    ("", -9, True, "timeout", False),
])
def test_sanitize_parses_sanitizer_summaries(text, rc, timed_out, result, clean):
    assert _sanitize().parse(text, rc, timed_out) == (result, clean)


def test_sanitize_runs_tables_and_exit_status_with_a_stand_in_sanitizer(tmp_path, monkeypatch, capsys):
    """The GPU half's plumbing on the CPU: a stand-in compute-sanitizer (clean memcheck, a racecheck hazard,
    a synccheck that hangs past --timeout) gives one log per run, summary.json, the table, exit status 1."""
    import torch
    from tile_ops.jit import launcher
    from tile_ops.jit.build import _find_tool

    if _find_tool("nvcc", "TILE_OPS_NVCC") is None:
        pytest.skip("nvcc not installed")
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/bash\ncase $2 in\n"
                    "  memcheck) echo '========= ERROR SUMMARY: 0 errors'; exit 0;;\n"
                    "  racecheck) echo '========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)'"
                    "; exit 1;;\n"
                    "  *) sleep 60 & wait;;\nesac\n")
    fake.chmod(0o755)
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in GPU")
    monkeypatch.setattr(launcher, "get_launcher", lambda: None)
    monkeypatch.setattr(sys, "argv", ["sanitize.py", "--sanitizer", str(fake), "--only", "matmul20", "--paths", "sm_90",
                                      "--timeout", "2", "--out", str(tmp_path), "-j", "3"])
    assert _sanitize().main() == 1
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "sanitize" / "summary.json").read_text())
    results = {(r["shape"].split()[0], r["tool"]): r["result"] for r in summary["runs"]}
    assert len(results) == 9 and len(list((tmp_path / "sanitize").glob("matmul20_sm_90_*.log"))) == 9
    assert all(results[(s, "memcheck")] == "clean" and results[(s, "racecheck")] == "1 errors"
               and results[(s, "synccheck")] == "timeout" for s in ("small", "ragged", "ragged-tma"))
    assert "3/9 clean" in out
    table = out[out.index("compute-sanitizer on stand-in GPU"):].splitlines()
    assert len(table) == 5 and "memcheck" in table[1] and "timeout" in table[-1]


def test_bench_gemm_compile_only_fills_the_cache_a_gpu_run_reuses(tmp_path):
    """`bench_gemm.py --compile-only` builds the benchmark's kernels on a machine without a GPU; with that
    cache carried to the GPU (TILE_OPS_CACHE_DIR), the run there needs no TVM (e.g. beside .tlkit)."""
    from tile_ops.jit.build import _find_tool

    if _find_tool("nvcc", "TILE_OPS_NVCC") is None:
        pytest.skip("no nvcc")
    env = {**os.environ, "TILE_OPS_CACHE_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_gemm.py"), "--compile-only", "--arch", "sm_90a",
                          "--shapes", "1000x1000x1000"], env=env, capture_output=True, text=True, check=True)
    assert "built 2 kernels for sm_90a" in out.stdout  # fp16 and bf16
    assert any(p.suffix == ".cubin" for p in tmp_path.rglob("*")), sorted(tmp_path.rglob("*"))[:10]


def test_tilelang_anchor_reports_why_it_is_missing():
    import tilelang_matmul

    reason = tilelang_matmul.available()
    assert reason is None or "tilelang" in reason


def test_bench_sustained_refuses_malformed_variants_and_a_missing_gpu():
    script = str(BENCHMARKS / "bench_sustained.py")
    bad = subprocess.run([sys.executable, script, "--variants", "default,raster"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--variants: variant 'raster': 'default' or '+'-joined rasterN" in bad.stderr
    if not __import__("torch").cuda.is_available():
        none = subprocess.run([sys.executable, script, "--shapes", "4096x4096x4096"], capture_output=True, text=True)
        assert none.returncode == 2 and "needs a CUDA GPU" in none.stderr


@pytest.mark.skipif(_find_tool("nvcc", "TILE_OPS_NVCC") is None or _find_tool("cuobjdump", "TILE_OPS_CUOBJDUMP") is None,
                    reason="needs nvcc and cuobjdump")
def test_bench_sustained_variants_change_the_named_fields_and_build(tmp_path, monkeypatch):
    """A variant is the shape's default config with the named fields changed; variants of the kinds the sustained
    runs compared (rasterization panels, multicast clusters) build for sm_90a."""
    import bench_sustained

    from tile_ops.kernels.gemm_defaults import default_config
    from tile_ops.kernels.gemm_launch import build_gemm

    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path))
    base = default_config(4096, 4096, 4096, "sm_90a")
    cfg = dataclasses.replace(base, **bench_sustained.variant_changes("cluster2+cluster_n2+raster0"))
    assert (cfg.cluster, cfg.cluster_n, cfg.swizzle) == (2, 2, 0)
    assert dataclasses.replace(cfg, cluster=1, cluster_n=1, swizzle=base.swizzle) == base
    assert bench_sustained.variant_changes("default") == {}
    for bad in ("raster", "cluster2+", "swizzle4", "raster4 "):
        with pytest.raises(ValueError, match="rasterN, clusterN, cluster_nN"):
            bench_sustained.variant_changes(bad)
    for name in ("raster8", "cluster2+raster4"):
        k = build_gemm(4096, 4096, 4096, cfg=dataclasses.replace(base, **bench_sustained.variant_changes(name)),
                       target="sm_90a")
        assert k.meta.cluster == (2 if "cluster2" in name else 1) and k.instruction_mix().get("HGMMA", 0) > 0


def test_profile_gemm_reads_back_every_config_name_bench_gemm_prints():
    """profile_gemm.py --config takes bench_gemm.py's names: each default and extra config reads back as
    itself, rasterization, swapping and warp policy included."""
    import bench_gemm
    import profile_gemm

    from tile_ops.kernels.gemm_config import GemmConfig
    from tile_ops.kernels.gemm_defaults import default_config

    shapes = [(4096, 4096, 4096), (1000, 1000, 1000), (16, 8192, 8192), (2048, 2048, 2048), (1500, 2000, 2000)]
    configs = [default_config(*s, "sm_90a") for s in shapes] + bench_gemm.EXTRA_CONFIGS["sm_90a"] + [
        GemmConfig(64, 128, 64, 8, 256, 8, epilogue="shared", cluster=2, policy="full_col")]
    assert {c.swizzle for c in configs} >= {0, 4, 8} and any(c.swap_ab for c in configs)
    assert {c.policy for c in configs} >= {"square", "full_col"}
    for cfg in configs:
        assert profile_gemm.parse_config(bench_gemm.config_name(cfg), GemmConfig) == cfg


def test_profile_gemm_stall_view_finds_each_of_our_gemm_kernels():
    """--stalls picks our kernel by name for ncu's source view: the plain, swapped and split-K gemm kernels all
    match the gemm pattern (a swap config's gemm_swapped_kernel did not: "No kernels were profiled"), and
    the fused softmax kernel matches only its own."""
    import re

    import profile_gemm

    from tile_ops.kernels import gemm_softmax, gemm_softmax_defaults
    from tile_ops.kernels.gemm import gemm
    from tile_ops.kernels.gemm_config import GemmConfig
    from tile_ops.kernels.gemm_defaults import default_config

    def cuda_name(program):  # TVM's codegen names the __global__ function <program>_kernel
        return program.name + "_kernel"

    def pattern(op):
        return profile_gemm.KERNEL_REGEX[op].removeprefix("regex:")

    configs = [default_config(1024, 1024, 1024, "sm_90a"),
               GemmConfig(72, 128, 64, 8, 256, 0, epilogue="shared", cluster=2, cluster_n=2, swap_ab=True),
               GemmConfig(128, 128, 64, 4, 128, split_k=2)]
    names = {cuda_name(gemm.fn(1000, 1000, 1000, 1, 1, 1, False, False, False, "float16", "float16", c))
             for c in configs}
    assert names == {"gemm_kernel_kernel", "gemm_swapped_kernel_kernel", "gemm_splitk_kernel_kernel"}
    assert all(re.search(pattern("gemm"), n) for n in names)
    fused = cuda_name(gemm_softmax.gemm_softmax.fn(256, 2048, 64, 0.125,
                                                   cfg=gemm_softmax_defaults.default_config(256, 2048, 64, "sm_90a")))
    assert re.search(pattern("gemm_softmax"), fused) and not re.search(pattern("gemm"), fused)
    assert not any(re.search(pattern("gemm_softmax"), n) for n in names)


def test_bench_gemm_says_where_issue_4s_targets_stand():
    """bench_gemm.py ends with issue 4's bars: a geomean and minimums over one dtype's rows it ran, met or
    not, and says when only some of a target's shapes ran; the other dtype's rows and B^T rows do not count."""
    import bench_gemm

    row = lambda shape, r, dt="float16": {"dtype": dt, "shape": shape, "vs_cuBLAS": r}  # noqa: E731
    rows = [row("4096x4096x4096", 0.979), row("8192x8192x8192", 1.026), row("8192x1024x8192", 0.986),
            row("4096x14336x4096", 0.984), row("1000x1000x1000", 0.904), row("777x3001x1234", 1.926),
            row("16x8192x8192 B^T", 0.5), row("2048x2048x2048", 0.5, "bfloat16")]
    lines = bench_gemm.target_lines(rows)
    assert lines[0].startswith("geomean of 4096^3") and "0.994, target >= 1.00: NOT met" in lines[0]
    assert "lowest of those four: 0.979, target >= 0.95: met" == lines[1]
    assert lines[2] == ("lowest of 1000^3 and the ragged shapes: 0.904, target >= 0.90: met "
                        "(only 2 of its 5 shapes ran)")
    assert len(lines) == 3  # no fp16 2048^3 and no decode row with B stored K x N
    assert bench_gemm.target_lines([row("16x8192x8192", 1.1)]) == ["decode 16x8192x8192: 1.100, target >= 1.00: met"]
    assert bench_gemm.target_lines(rows, "bfloat16") == ["2048^3: 0.500, target >= 0.95: NOT met"]
    # every bar's shapes run in both dtypes
    bars = {s for _, shapes, _, _ in bench_gemm.TARGETS for s in shapes}
    assert all(bars <= set(shapes) for shapes in bench_gemm.SHAPES.values())


def test_bench_sustained_prints_each_variants_geomean():
    import bench_sustained

    rows = [{"kernel": "cuBLAS", "vs_cuBLAS": 1.0}, {"kernel": "default", "vs_cuBLAS": 0.995},
            {"kernel": "raster8", "vs_cuBLAS": 0.999}, {"kernel": "cuBLAS", "vs_cuBLAS": 1.0},
            {"kernel": "default", "vs_cuBLAS": 1.018}, {"kernel": "raster8", "vs_cuBLAS": 1.012}]
    assert bench_sustained.geomean_lines(rows) == ["default: geomean 1.006 of cuBLAS over 2 shape(s)",
                                                   "raster8: geomean 1.005 of cuBLAS over 2 shape(s)"]


def test_bench_gemm_checks_an_anchor_before_timing_it(monkeypatch, capsys):
    """The Triton and TileLang anchors are checked against the float64 reference like ours: a wrong anchor
    is reported WRONG (and not timed), a right one timed; a Triton column was timed unchecked."""
    import torch

    import bench_gemm

    timed = []
    monkeypatch.setattr(bench_gemm, "bench_ms", lambda fn: timed.append(fn) or 2.0)
    a, b = torch.randn(64, 32, dtype=torch.float64), torch.randn(32, 48, dtype=torch.float64)
    ref = a @ b
    tflops = lambda ms: 2 * 64 * 48 * 32 / ms / 1e9  # noqa: E731
    right = bench_gemm.checked_tflops(lambda: (a @ b).half(), ref, 5e-3, tflops, "triton float16 64x48x32")
    assert right == round(tflops(2.0), 1) and len(timed) == 1
    wrong = bench_gemm.checked_tflops(lambda: (a @ b.flip(1)).half(), ref, 5e-3, tflops, "triton float16 64x48x32")
    assert wrong == "WRONG" and len(timed) == 1
    assert "WRONG triton float16 64x48x32: relative error" in capsys.readouterr().err
    nan = bench_gemm.checked_tflops(lambda: torch.full((64, 48), float("nan")), ref, 5e-3, tflops, "x")
    assert nan == "WRONG" and len(timed) == 1


def test_bench_gemm_targets_with_a_shape_no_config_got_right():
    """A shape whose configs were all WRONG has ratio 0: its targets read NOT met (the geomean used to raise
    StatisticsError after the table, losing the --json)."""
    import bench_gemm

    rows = [{"dtype": "float16", "shape": s, "vs_cuBLAS": r}
            for s, r in (("4096x4096x4096", 0.0), ("8192x8192x8192", 1.02), ("2048x2048x2048", 0.97))]
    lines = bench_gemm.target_lines(rows)
    assert lines[0].startswith("geomean of 4096^3") and "0.000, target >= 1.00: NOT met" in lines[0]
    assert "no correct kernel" in lines[0] and "NOT met" in lines[1]
    assert lines[2] == "2048^3: 0.970, target >= 0.95: met"


def test_sanitize_runs_of_one_shape_under_two_labels_keep_their_own_logs(tmp_path):
    """gemm's "ragged" and "padded" runs share the shape 127x255x129: each run's log is its own (they were
    one file, written by both runs, and both summary records pointed at it)."""
    san = _sanitize()
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/bash\necho \"run of label ${@: -1}\"; echo '========= ERROR SUMMARY: 0 errors'\n")
    fake.chmod(0o755)
    shape = dict(san.SHAPES["gemm"])["ragged"]
    assert dict(san.SHAPES["gemm"])["padded"] == shape
    results = [san.run_one(str(fake), ("gemm", "sm_90a", label, shape, "memcheck"), 30000, str(tmp_path), 30,
                           dict(os.environ)) for label in ("ragged", "padded")]
    assert [r["result"] for r in results] == ["clean", "clean"]
    assert results[0]["log"] != results[1]["log"]
    for r, label in zip(results, ("ragged", "padded")):
        assert f"run of label {label}" in pathlib.Path(r["log"]).read_text()


def _run_gpu_session(tmp_path, **env):
    """benchmarks/gpu_session.sh with a stand-in python (and nvidia-smi) whose GPU tests fail, bench_gemm.py
    fails, bench_gemm_softmax.py hangs and any other script succeeds; (exit status, output, $OUT)."""
    bin_dir, out, cwd = tmp_path / "bin", tmp_path / "out", tmp_path / "checkout"
    bin_dir.mkdir(), cwd.mkdir()
    (bin_dir / "python").write_text(
        "#!/bin/bash\n"
        'case "$1 ${2:-}" in "-m pip") exit 0;; "-c "*) echo "launcher: tile_ops._C"; exit 0;;\n'
        '  "-m pytest") echo "[gw1] [ 33%] FAILED tests/x.py::test_y "; printf "[gw0] PASSED\\n%.0s" 1 2 3\n'
        '    echo "1 failed, 2 passed"; exit 1;; esac\n'
        'case "$1" in benchmarks/bench_gemm.py) echo "Traceback: boom"; exit 1;;\n'
        '  benchmarks/bench_gemm_softmax.py) exec sleep 30;; *) echo "ran $1"; exit 0;; esac\n')
    (bin_dir / "nvidia-smi").write_text("#!/bin/bash\necho 'name, clocks.sm'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), **env)
    proc = subprocess.run(["bash", str(BENCHMARKS / "gpu_session.sh")], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr, out


def test_gpu_session_says_which_steps_failed_and_exits_nonzero(tmp_path):
    """A benchmark that fails, one killed by BENCH_TIMEOUT, failing GPU tests and an unknown BENCHES name
    are each said ("FAILED: ..."), listed in $OUT/failures.txt, and make the exit status 1; the steps after
    them still run. (The script used to exit with the last step's status, and a timed-out benchmark's log
    just stopped.)"""
    rc, text, out = _run_gpu_session(tmp_path, TESTS="tests/x.py", BENCHES="gemm softmax overhead sofmax",
                                     BENCH_TIMEOUT="2")
    assert rc == 1, text
    assert "FAILED: tests: exit status 1" in text and "FAILED: gemm: exit status 1" in text
    assert "[gw1] [ 33%] FAILED tests/x.py::test_y" in text  # named though far above the summary's tail
    assert "FAILED: softmax: timed out after 2 s" in text and "FAILED: sofmax: unknown benchmark" in text
    assert "ran benchmarks/bench_overhead.py" in text and "FAILED: overhead" not in text
    assert text.rstrip().endswith("gpu_session.sh: FAILED: tests gemm softmax sofmax")
    assert len((out / "failures.txt").read_text().splitlines()) == 4
    assert "Traceback: boom" in (out / "bench_gemm.log").read_text()


def test_gpu_session_runs_nothing_for_none(tmp_path):
    """TESTS=none and BENCHES=none: only the install and the GPU line, and exit 0 (BENCHES=none used to be
    an unknown benchmark, failing a tests-only call)."""
    rc, text, out = _run_gpu_session(tmp_path, TESTS="none", BENCHES="none")
    assert rc == 0, text
    assert text.rstrip().endswith("gpu_session.sh: every step passed")
    assert "FAILED" not in text and "ran " not in text and not (out / "failures.txt").exists()


def _torch_logging_the_profiler_range(log):
    """A stand-in for torch in profile_gemm.profiled_calls: its profiler start/stop append to ``log``."""
    import types

    return types.SimpleNamespace(cuda=types.SimpleNamespace(
        synchronize=lambda: None,
        profiler=types.SimpleNamespace(start=lambda: log.append("start"), stop=lambda: log.append("stop"))))


def test_profile_gemm_profiles_every_kernel_of_the_second_calls():
    """profile_gemm.py profiles the second call of ours and of cuBLAS whatever number of kernels each launches:
    a profiler range around them, not a fixed launch window ("skip 4, count 2" after the two randn kernels,
    which at decode, where cuBLAS launches its GEMM and a splitKreduce_kernel, profiled the reduce and ours)."""
    import profile_gemm

    log = []
    fake = _torch_logging_the_profiler_range(log)
    ours = lambda: log.extend(["splitk_partial", "splitk_reduce"])  # noqa: E731
    cublas = lambda: log.extend(["nvjet_gemm", "splitKreduce_kernel"])  # noqa: E731
    profile_gemm.profiled_calls(ours, cublas, fake)
    profiled = log[log.index("start") + 1:log.index("stop")]
    assert profiled == ["splitk_partial", "splitk_reduce", "nvjet_gemm", "splitKreduce_kernel"]
    assert log[:log.index("start")] == profiled  # one warm-up call of each before
    cmd = profile_gemm.ncu_cmd(["gpu__time_duration.sum"], ["python", "child"])
    assert cmd[cmd.index("--profile-from-start") + 1] == "off" and "--launch-skip" not in cmd


def test_profile_gemm_dirty_l2_flushes_before_each_profiled_call_and_keeps_the_state():
    """--l2 dirty profiles each kernel after Triton's zeroed flush, as bench_gemm.py times it: the flush runs
    before each profiled call, and ncu neither cleans the caches nor restores memory between passes."""
    import profile_gemm

    log = []
    fake = _torch_logging_the_profiler_range(log)
    profile_gemm.profiled_calls(lambda: log.append("ours"), lambda: log.append("cublas"), fake,
                                lambda: log.append("flush"))
    assert log == ["ours", "cublas", "start", "flush", "ours", "flush", "cublas", "stop"]
    dirty = profile_gemm.ncu_cmd(["gpu__time_duration.sum"], ["python", "child"], "dirty")
    assert dirty[dirty.index("--cache-control") + 1] == "none"
    assert dirty[dirty.index("--replay-mode") + 1] == "application"
    assert "--cache-control" not in profile_gemm.ncu_cmd(["gpu__time_duration.sum"], ["python", "child"])


def test_profile_gemm_dirty_run_tells_the_child_and_leaves_the_flush_out_of_the_table(monkeypatch, capsys):
    """The child process learns the L2 state (it runs the flush), and the flush's fill kernel, profiled in the
    same range, is not a row of the table: only ours and cuBLAS's."""
    import types

    import profile_gemm

    seen = []
    rows = [("1", "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>>", "9.9"),
            ("2", "gemm_kernel_kernel", "9.15"), ("3", "void at::native::vectorized_elementwise_kernel<4, "
                                                   "at::native::FillFunctor<int>>", "9.9"),
            ("4", "nvjet_sm90_hsh_128x72_64x8_4x2_h_bz_NNT", "8.29")]
    csv_text = '"ID","Kernel Name","Metric Name","Metric Value"\n' + "".join(
        f'"{i}","{name}","gpu__time_duration.sum","{float(us) * 1e3}"\n' for i, name, us in rows)

    def run(cmd, **_):
        seen.append(cmd)
        return types.SimpleNamespace(returncode=0, stdout=csv_text, stderr="")

    monkeypatch.setattr(profile_gemm.subprocess, "run", run)
    monkeypatch.setattr(sys, "argv", ["profile_gemm.py", "--shape", "1000x1000x1000", "--l2", "dirty"])
    profile_gemm.main()
    child = seen[0][seen[0].index("--child"):]
    assert child[child.index("--l2") + 1] == "dirty"
    out = capsys.readouterr().out
    assert "FillFunctor" not in out and "gemm_kernel_kernel" in out and "nvjet_sm90" in out


def test_paired_medians_alternate_call_by_call_and_take_each_ones_median(monkeypatch):
    """bench_gemm.py (ours, cuBLAS) and bench_gemm_softmax.py (fused, torch) time the two call by call in turn,
    each call after the L2 flush, and report each one's median: blocks of 200 ms, one function's at a time,
    each took a mode of its own (at 1000^3 on the H200), and a winner's single sweep timing met torch's one timing."""
    import bench_gemm
    import bench_gemm_softmax

    order, times = [], {"fused": iter([1.0, 1.2, 0.9, 1.1, 5.0]), "torch": iter([2.0, 2.4, 2.2, 2.1, 2.3])}

    class Event:
        def __init__(self, name):
            self.name = name

        def elapsed_time(self, end):
            return next(times[self.name])

    monkeypatch.setattr(common, "l2_flusher", lambda: lambda: order.append("flush"))
    monkeypatch.setattr(common, "_round_ms", lambda fns, flush: 1.0)  # 5 rounds of rep_ms=5: the minimum
    monkeypatch.setattr(common, "timed_call", lambda fn, flush: (flush(), fn(), (Event(order[-1]), None))[2])
    monkeypatch.setattr(common.torch.cuda, "synchronize", lambda: None)
    got = common.paired_medians({"fused": lambda: order.append("fused"), "torch": lambda: order.append("torch")},
                                rep_ms=5, warmup_ms=0)
    assert order == ["flush", "fused", "flush", "torch"] * 6  # one warm-up round, then five timed
    assert got == {"fused": 1.1, "torch": 2.2}
    assert bench_gemm_softmax.paired_medians is common.paired_medians is bench_gemm.paired_medians
    # another flush (benchmarks/l2_state.py's clean or warm L2) runs before every call instead
    order.clear()
    times.update(fused=iter([1.0] * 5), torch=iter([2.0] * 5))
    monkeypatch.setattr(common, "l2_flusher", lambda: pytest.fail("a given flush is used as it is"))
    common.paired_medians({"fused": lambda: order.append("fused"), "torch": lambda: order.append("torch")},
                          rep_ms=5, warmup_ms=0, flush=lambda: order.append("mine"))
    assert order == ["mine", "fused", "mine", "torch"] * 6


def test_bench_gemm_softmax_checks_the_gemm_it_holds_the_fused_kernel_to():
    """The our_gemm column (the fused kernel's 1.3x bar) was timed unchecked, from the bare gemm kernel rather
    than what build_gemm launches (split-K, padding)."""
    import bench_gemm_softmax

    a, b = torch.randn(8, 16, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)
    out = torch.empty(8, 4, dtype=torch.float64)
    bench_gemm_softmax.check_gemm_alone(lambda: out.copy_(a @ b), out, a, b)
    with pytest.raises(SystemExit, match=r"our gemm alone is wrong at \(8, 4\)x16"):
        bench_gemm_softmax.check_gemm_alone(lambda: out[:4].copy_((a @ b)[:4]), out, a, b)  # half the rows
    assert bench_gemm_softmax.build_gemm.__module__ == "tile_ops.kernels.gemm_launch"


def test_l2_state_promotions_relaunch_the_same_cubin_with_other_l2_fills():
    """benchmarks/l2_state.py times one cubin under several tensor-map L2 promotions: every map, or per
    operand; bad names are refused with what is accepted; a composed gemm (padded, split K) takes none."""
    import l2_state
    from test_kernel_meta import A_TMAP, FakeEncoder, _meta

    from tile_ops.jit.kernel import EntryArgs, Kernel

    b_tmap = {**A_TMAP, "tensor": "B", "dims": [128, 64]}
    base = Kernel(_meta(kept=("A_tmap", "B_tmap", "C"), tensormaps={"A_tmap": A_TMAP, "B_tmap": b_tmap}), "// src",
                  b"cubin")
    assert l2_state.with_l2_promotion(base, "compiled") is base

    def promotions(kernel):
        encode = FakeEncoder()
        EntryArgs(kernel.meta, encode).build([0x1000, 0x2000, 0x3000], device=0)
        return [call[7] for call in encode.calls]  # l2_promotion, A then B

    assert promotions(base) == [2, 2]
    for spec, want in (("none", [0, 0]), ("256", [3, 3]), ("A:64", [1, 2]), ("A:none+B:128", [0, 2]),
                       ("B:256", [2, 3])):
        k = l2_state.with_l2_promotion(base, spec)
        assert k.cubin is base.cubin and k.meta.entry == base.meta.entry and promotions(k) == want, spec
        assert {n: {**m, "l2_promotion": 2} for n, m in k.meta.tensormaps.items()} == base.meta.tensormaps
    assert promotions(base) == [2, 2]  # the compiled kernel is untouched
    with pytest.raises(ValueError, match=r"'32' is not an L2 fill size; accepted: none, 64, 128, 256"):
        l2_state.with_l2_promotion(base, "32")
    with pytest.raises(ValueError, match=r"'C' is no tensor this kernel loads through TMA; it has A, B"):
        l2_state.with_l2_promotion(base, "C:none")

    class Padded:  # what build_gemm returns around the gemm where rows need padding
        pass

    padded = Padded()
    assert l2_state.with_l2_promotion(padded, "compiled") is padded
    with pytest.raises(ValueError, match="only 'compiled' is accepted"):
        l2_state.with_l2_promotion(padded, "none")


def test_l2_state_arguments_and_summary():
    import l2_state

    args = l2_state.parse_args(["--shapes", "1000x1000x1000,64x128x256", "--states", "dirty,warm"])
    assert args.shapes == [(1000, 1000, 1000), (64, 128, 256)] and args.states == ["dirty", "warm"]
    assert args.promotions == ["compiled", "none", "64", "128", "256"] and (args.flushes, args.operand_sets) == (3, 2)
    with pytest.raises(SystemExit):
        l2_state.parse_args(["--states", "dirty,cold"])
    rows = [{"shape": "1x1x1", "state": st, "r compiled": r, "r none": r + 0.1}
            for st, r in (("dirty", 0.9), ("dirty", 1.0), ("dirty", 0.8), ("warm", 1.1))]
    got = l2_state.summary(rows, ["compiled", "none"], ["dirty", "warm"])
    assert got[0] == {"shape": "1x1x1", "state": "dirty", "promotion": "compiled", "rows": 3, "median": 0.9,
                      "lowest": 0.8}
    assert got[1]["median"] == 1.0 and got[3] == {"shape": "1x1x1", "state": "warm", "promotion": "none", "rows": 1,
                                                   "median": 1.2, "lowest": 1.2}


def test_l2_state_compile_only_builds_the_kernel_its_promotions_apply_to(tmp_path):
    from tile_ops.jit.build import _find_tool

    if _find_tool("nvcc", "TILE_OPS_NVCC") is None:
        pytest.skip("no nvcc")
    env = {**os.environ, "TILE_OPS_CACHE_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(BENCHMARKS / "l2_state.py"), "--compile-only", "--shapes", "1000x1000x1000"]
    out = subprocess.run(cmd + ["--promotions", "compiled,none,A:64+B:128"], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "built 1 kernels for sm_90a" in out.stdout, out.stderr
    assert any(p.suffix == ".cubin" for p in tmp_path.rglob("*"))
    out = subprocess.run(cmd + ["--promotions", "D:none"], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "'D' is no tensor this kernel loads through TMA; it has A, B, C" in out.stderr


def test_profile_gemm_l2_sources_fall_back_when_ncu_lacks_them(monkeypatch, capsys):
    """--l2-sources asks ncu for the L2's sectors by source and its reads beside the bytes into the SMs as well;
    an ncu that lacks the newer two keeps the older two sources, one that lacks all of them still gets the base
    counters, and the table shows the columns of the set that ran."""
    import types

    import profile_gemm

    sources = list(profile_gemm.L2_SOURCES)
    asked, known = [], set()

    def run(cmd, **_):
        metrics = cmd[cmd.index("--metrics") + 1].split(",")
        asked.append(metrics)
        if any(m in sources and m not in known for m in metrics):
            return types.SimpleNamespace(returncode=1, stdout="==ERROR== unknown metric", stderr="")
        rows = "".join(f'"1","gemm_kernel_kernel","{m}","1000"\n' for m in metrics)
        return types.SimpleNamespace(returncode=0, stdout='"ID","Kernel Name","Metric Name","Metric Value"\n' + rows,
                                     stderr="")

    def table_header():
        asked.clear()
        profile_gemm.main()
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("kernel"))

    monkeypatch.setattr(profile_gemm.subprocess, "run", run)
    monkeypatch.setattr(sys, "argv", ["profile_gemm.py", "--shape", "64x64x64", "--l2-sources"])
    header = table_header()
    assert len(asked) == 3 and set(sources) <= set(asked[0]) and asked[2] == list(profile_gemm.METRICS)
    assert "l2_MB" in header and "l2_fabric_MB" not in header
    known.update(sources[:2])  # an ncu with the two older sources only
    header = table_header()
    assert len(asked) == 2 and "l2_fabric_MB" in header and "into_sms_MB" not in header
    known.update(sources)
    header = table_header()
    assert len(asked) == 1 and {"l2_from_sm_MB", "l2_fabric_MB", "l2_reads_MB", "into_sms_MB"} <= set(header.split())


def _patch_of(path: pathlib.Path, old: str, new: str) -> str:
    """A unified diff of the repository file ``path`` replacing ``old`` with ``new`` (git's a/ b/ paths)."""
    import difflib

    rel = path.relative_to(BENCHMARKS.parent).as_posix()
    text = path.read_text()
    assert old in text
    return "".join(difflib.unified_diff(text.splitlines(True), text.replace(old, new, 1).splitlines(True),
                                        f"a/{rel}", f"b/{rel}"))


def test_ab_compiler_variant_imports_its_patched_copy_with_its_own_cache_keys(tmp_path):
    """The variant's processes import the patched copy of tile_ops, whose compiler fingerprint (the JIT key's
    hash of the compiler's sources) differs from main's, so both variants' kernels share one cache; main's
    files stay as they were."""
    import ab_compiler

    module = BENCHMARKS.parent / "tile_ops" / "compiler" / "schedules" / "warp_specialized.py"
    before = module.read_text()
    patch = tmp_path / "v.patch"
    patch.write_text(_patch_of(module, "PRODUCER_THREADS = 128", "PRODUCER_THREADS = 128  # a variant"))
    root = ab_compiler.overlay(str(patch), str(tmp_path / "root"))
    assert module.read_text() == before and "# a variant" in (tmp_path / "root/tile_ops/compiler/schedules/warp_specialized.py").read_text()
    probe = ("import tile_ops.compiler.schedules.warp_specialized as m; from tile_ops.jit import compiler_fingerprint as f; "
             "print(m.__file__, f())")
    seen = [subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
                           check=True).stdout.split() for env in (ab_compiler.environ(), ab_compiler.environ(root))]
    assert seen[0][0] == str(module) and seen[1][0] == str(tmp_path / "root/tile_ops/compiler/schedules/warp_specialized.py")
    assert seen[0][1] != seen[1][1]


def test_ab_compiler_refuses_a_patch_that_does_not_apply(tmp_path):
    import ab_compiler

    module = BENCHMARKS.parent / "tile_ops" / "compiler" / "schedules" / "warp_specialized.py"
    patch = tmp_path / "stale.patch"
    patch.write_text(_patch_of(module, "PRODUCER_THREADS = 128", "PRODUCER_THREADS = 96")
                     .replace("-PRODUCER_THREADS = 128", "-PRODUCER_THREADS = 64"))
    with pytest.raises(SystemExit, match="does not apply to this tile_ops"):
        ab_compiler.overlay(str(patch), str(tmp_path / "root"))


def test_ab_compiler_rounds_alternate_and_the_summary_takes_medians(tmp_path, monkeypatch, capsys):
    """Rounds alternate main and variant processes of bench_gemm.py; --compile-only builds both for sm_90a; the
    table shows every process's ratio, the medians, and µs from TFLOP/s."""
    import ab_compiler

    module = BENCHMARKS.parent / "tile_ops" / "compiler" / "schedules" / "warp_specialized.py"
    patch = tmp_path / "v.patch"
    patch.write_text(_patch_of(module, "PRODUCER_THREADS = 128", "PRODUCER_THREADS = 128  # a variant"))
    ratios = {"main": iter([0.90, 0.95, 0.93]), "variant": iter([1.00, 0.97, 0.99])}
    calls, real_run = [], subprocess.run

    def run(cmd, env=None, check=False, **kw):
        if cmd[0] == "git":  # the overlay's git apply
            return real_run(cmd, env=env, check=check, **kw)
        calls.append((cmd, env["PYTHONPATH"].split(os.pathsep)[0]))
        if "--json" in cmd:
            path = cmd[cmd.index("--json") + 1]
            r = next(ratios[pathlib.Path(path).stem.rstrip("0123456789").removeprefix("gemm_")])
            row = {"dtype": "float16", "shape": "1000x1000x1000", "tile_ops": 200.0 * r, "cuBLAS": 200.0,
                   "vs_cuBLAS": r}
            pathlib.Path(path).write_text(json.dumps({"rows": [row]}))

    monkeypatch.setattr(ab_compiler.subprocess, "run", run)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["ab_compiler.py", str(patch), "--out", str(out), "--compile-only"])
    ab_compiler.main()
    assert [c[0][-3:] for c in calls] == [["--arch", "sm_90a", "--compile-only"]] * 2
    assert calls[0][1] == str(BENCHMARKS.parent) and calls[1][1] == str(out / "variant_root")
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["ab_compiler.py", str(patch), "--out", str(out)])
    ab_compiler.main()
    assert [pathlib.Path(c[0][-1]).stem for c in calls] == ["gemm_main1", "gemm_variant1", "gemm_main2",
                                                            "gemm_variant2", "gemm_main3", "gemm_variant3"]
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row[:3] == ["gemm", "float16", "1000x1000x1000"]
    assert row[3:9] == ["0.900", "0.950", "0.930", "1.000", "0.970", "0.990"] and row[9:12] == ["0.93", "0.99", "1.065"]
    assert float(row[-1]) == pytest.approx(2 * 1000 ** 3 / 200.0 / 1e6, abs=1e-3)  # cuBLAS µs


def test_compare_configs_summarizes_rounds_and_reads_every_name():
    """compare_configs.py: each config's ratio per process and their median; a config wrong or refused in
    a process shows there as "-" and does not count; its names are bench_gemm.py's (warp policy included)."""
    import bench_gemm
    import compare_configs
    import profile_gemm

    from tile_ops.kernels.gemm_config import GemmConfig

    r = lambda cfg, ratio, us: {"shape": "1000x1000x4000", "config": cfg, "vs_cuBLAS": ratio, "us": us}  # noqa: E731
    rounds = [[r("cuBLAS", 1.0, 20.0), r("default", 0.9, 22.2), r("x", None, None)],
              [r("cuBLAS", 1.0, 20.4), r("default", 0.94, 21.7), r("x", 0.5, 40.0)],
              [r("cuBLAS", 1.0, 20.2), r("default", 0.92, 22.0), r("x", 0.7, 29.0)]]
    rows = {row["config"]: row for row in compare_configs.summary(rounds)}
    assert rows["default"] == {"shape": "1000x1000x4000", "config": "default", "per_process": "0.900 0.940 0.920",
                               "median": 0.92, "us": 22.0}
    assert rows["x"]["per_process"] == "- 0.500 0.700" and rows["x"]["median"] == 0.6
    cfg = GemmConfig(64, 128, 64, 8, 256, 8, epilogue="shared", cluster=2, policy="full_col")
    assert bench_gemm.config_name(cfg) == "64x128x64/s8/t256/tma-store/cluster2/full_col"
    assert profile_gemm.parse_config(bench_gemm.config_name(cfg), GemmConfig) == cfg


def test_compare_configs_runs_a_process_per_round_and_keeps_what_finished(monkeypatch, tmp_path, capsys):
    """The parent checks names and shapes before any GPU work, runs one child per round (each writes its rows
    to the file it is given), prints the table and the JSON; a failed round stops the rounds, the finished
    ones are still reported, and the exit status says it failed."""
    import compare_configs

    calls = []

    def child(cmd, **kw):
        calls.append(cmd)
        out = cmd[cmd.index("--child-out") + 1]
        if len(calls) == 3:  # the third round dies
            return subprocess.CompletedProcess(cmd, 1)
        rows = [{"shape": "64x64x64", "config": c, "us": 5.0, "vs_cuBLAS": r}
                for c, r in (("cuBLAS", 1.0), ("default", 0.9 + 0.02 * len(calls)))]
        pathlib.Path(out).write_text(json.dumps(rows))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compare_configs.subprocess, "run", child)
    report = tmp_path / "c.json"
    with pytest.raises(SystemExit) as exit_:
        compare_configs.main(["--configs", "default,default", "--shapes", "64x64x64", "--rounds", "4",
                              "--json", str(report)])
    assert exit_.value.code == 1 and len(calls) == 3
    assert all(c[c.index("--shapes") + 1] == "64x64x64" for c in calls)
    out = capsys.readouterr()
    assert "round 3 failed" in out.err and "0.920 0.940" in out.out and "2 processes" in out.out
    assert [r["median"] for r in json.loads(report.read_text())["rows"] if r["config"] == "default"] == [0.93]
    for bad in (["--configs", "64x128x64/s8/t128/tma_store"], ["--configs", "default", "--shapes", "64x64"]):
        with pytest.raises(SystemExit):
            compare_configs.main(bad)
    assert len(calls) == 3  # refused before any child ran


@pytest.mark.parametrize("name, why", [("64x128/s8", "must start BMxBNxBK"), ("64x128x64/s8/t128/tma_store",
                                       "unknown part 'tma_store'"), ("64x128x64/s8/t128/fullcol", "unknown part")])
def test_profile_gemm_refuses_a_config_name_it_cannot_read(name, why):
    """A misspelt part is an error, not a silently different kernel timed under the name given."""
    import profile_gemm

    from tile_ops.kernels.gemm_config import GemmConfig

    with pytest.raises(ValueError, match=why):
        profile_gemm.parse_config(name, GemmConfig)


def test_fastest_correct_leaves_out_wrong_and_failed_kernels(monkeypatch, capsys):
    """A kernel whose check launch raises is reported FAILED, a wrong one WRONG; neither is timed, and the
    fastest of the rest wins."""
    times = {"fast": 1.0, "slow": 2.0, "wrong": 0.1, "fails": 0.1}
    monkeypatch.setattr(common, "bench_ms", lambda fn: fn())

    def check(k):
        if k == "fails":
            raise RuntimeError("cuLaunchKernelEx: cluster misconfiguration")
        return 1.0 if k == "wrong" else 1e-4

    best = common.fastest_correct({k: k for k in times}, check, lambda k: times[k], 5e-3, str, str)
    assert best == (1.0, 1e-4, "fast")
    err = capsys.readouterr().err
    assert "FAILED fails: RuntimeError: cuLaunchKernelEx: cluster misconfiguration" in err and "WRONG wrong" in err


def test_compare_configs_round_times_only_configs_that_build_launch_and_are_right(monkeypatch, capsys):
    """One round on CPU stand-ins: a config the shape refuses, one whose launch raises and one that computes
    the wrong product are said and left out (None in the rows); cuBLAS and the right ones are timed together."""
    import bench_gemm
    import compare_configs
    import common

    tensors = {}

    def on_cpu(make):
        def made(*args, device=None, **kw):
            t = make(*args, **kw)
            tensors[t.data_ptr()] = t
            return t
        return made

    class Kernel:
        def __init__(self, how):
            self.how = how

        def launch_ptrs(self, ptrs, device):
            a, b, c = (tensors[p] for p in ptrs[:3])
            if self.how == "fails":
                raise RuntimeError("cluster misconfiguration")
            c.copy_(a @ b if self.how == "right" else a @ b + 1)

    how = {(64, 128, 64): "right", (128, 128, 64): "wrong", (128, 64, 64): "fails"}

    def kernels_for(M, N, K, dtype, trans_B, configs, arch):
        cfg = configs[0]
        if cfg.block_M == 256:
            return {}  # refused by the shape
        return {cfg: Kernel(how.get((cfg.block_M, cfg.block_N, cfg.block_K), "right"))}

    timed = []
    monkeypatch.setattr(torch, "randn", on_cpu(torch.randn))
    monkeypatch.setattr(torch, "full", on_cpu(torch.full))
    monkeypatch.setattr(bench_gemm, "kernels_for", kernels_for)
    monkeypatch.setattr(common, "paired_medians", lambda fns, rep_ms: timed.append(set(fns)) or
                        {n: (2.0 if n == "cuBLAS" else 2.5) for n in fns})
    names = ["default", "64x128x64/s8/t128", "128x128x64/s4/t128", "128x64x64/s4/t128", "256x128x64/s3/t256"]
    rows = compare_configs.run_round([(64, 64, 64)], names, "float32", 10)
    assert timed == [{"cuBLAS", "default", "64x128x64/s8/t128"}]
    ratio = {r["config"]: r["vs_cuBLAS"] for r in rows}
    assert ratio == {"cuBLAS": 1.0, "default": 0.8, "64x128x64/s8/t128": 0.8, "128x128x64/s4/t128": None,
                     "128x64x64/s4/t128": None, "256x128x64/s3/t256": None}
    err = capsys.readouterr().err
    assert "WRONG 64x64x64 128x128x64/s4/t128" in err and "FAILED 64x64x64 128x64x64/s4/t128: RuntimeError" in err
