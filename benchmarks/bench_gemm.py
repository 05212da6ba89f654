"""GEMM TFLOP/s: tile_ops beside torch.matmul (cuBLAS) and an autotuned Triton matmul, one run.

    python benchmarks/bench_gemm.py [--arch sm_90a|sm_90] [--configs] [--shapes MxNxK,...] [--no-triton]
                                    [--tilelang] [--compile-only] [--json out.json] [--png out.png]

Rows marked "B^T" store B transposed (N x K, nn.Linear's weight); cuBLAS gets the same layout.

``--arch sm_90a`` (the default on Hopper) is the TMA + wgmma warp-specialized path; ``--arch sm_90``
compiles the same programs through the Ampere-class path (cp.async + mma.sync) for the same GPU.
"""

import argparse
import concurrent.futures as cf
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import LARGE_SHAPES, bench_ms, fastest_correct, paired_medians, pick_shapes, png_path_or_none, print_table, save  # noqa: E402
import tilelang_matmul  # noqa: E402

from tile_ops.jit import default_arch  # noqa: E402
from tile_ops.kernels.gemm_config import GemmConfig  # noqa: E402
from tile_ops.kernels.gemm_defaults import default_config  # noqa: E402
from tile_ops.kernels.gemm_launch import build_gemm  # noqa: E402

# issue 4's ragged shapes beside 1000^3 (>= 0.90x cuBLAS): mid grids that fill 1.4-2.4 waves of 128x128 tiles, one
# whose rows are not 16-byte aligned (padded for TMA), and 1000^3's grid with a long K (half a wave, 63 k-steps:
# the short grid where the default was weakest when it joined)
RAGGED_SHAPES = [(1000, 1000, 1000), (1500, 2000, 2000), (3000, 1000, 1500), (777, 3001, 1234), (1000, 1000, 4000)]
DECODE = (16, 8192, 8192)
# ../shared/ANCHORS.md's shapes and issue 4's bars, in both dtypes; fp16 adds, after the anchor's decode shape,
# two whose default tiles are unsplit: 64 rows, and 16 rows of a 14336-wide MLP projection
BAR_SHAPES = [(2048, 2048, 2048), *LARGE_SHAPES, *RAGGED_SHAPES, DECODE]
SHAPES = {"float16": BAR_SHAPES + [(64, 8192, 8192), (16, 14336, 4096)], "bfloat16": BAR_SHAPES}
# B stored transposed (N x K: nn.Linear's weight, what a model's decode step multiplies by), fp16
TRANSPOSED_B = [DECODE]
EXTRA_CONFIGS = {
    "sm_90": [GemmConfig(128, 128, 32, 3, 128, 8), GemmConfig(128, 256, 32, 4, 256, 8),
              GemmConfig(256, 128, 32, 3, 256, 8), GemmConfig(128, 128, 64, 3, 256, 8)],
    "sm_90a": [GemmConfig(128, 256, 64, 4, 256, 8), GemmConfig(256, 128, 64, 4, 256, 8),
               GemmConfig(128, 128, 64, 5, 128, 8), GemmConfig(128, 128, 64, 5, 256, 8),
               GemmConfig(128, 64, 64, 6, 128, 8), GemmConfig(64, 128, 64, 6, 128, 0),
               # one consumer warpgroup in <= 113 KiB: two CTAs per SM
               GemmConfig(128, 128, 64, 3, 128, 8), GemmConfig(128, 64, 64, 4, 128, 8),
               # the output tile staged in shared memory and stored by TMA
               GemmConfig(128, 256, 64, 3, 256, 8, epilogue="shared"),
               GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared"),
               GemmConfig(128, 128, 64, 2, 128, 8, epilogue="shared"),
               GemmConfig(128, 256, 64, 3, 256, 8, "full_col", epilogue="shared"),  # warpgroups split N
               # short grids (1000^3: 64 tiles of 128x128): deeper K steps, narrower tiles, split K
               GemmConfig(128, 128, 128, 3, 128, 8, epilogue="shared"),
               GemmConfig(128, 64, 64, 4, 128, 8, epilogue="shared"),
               GemmConfig(64, 128, 64, 6, 128, 8, epilogue="shared"), GemmConfig(128, 128, 64, 4, 128, 8, split_k=2),
               # 1000^3, what cuBLAS's nvjet 128x72 kernel suggests: 112-128 CTAs, deep pipelines,
               # and clusters (cuBLAS reads 24 % fewer L2 bytes than our 128x128)
               GemmConfig(128, 128, 64, 6, 128, 8, epilogue="shared"), GemmConfig(128, 64, 64, 8, 128, 8, epilogue="shared"),
               GemmConfig(128, 64, 64, 6, 128, 8, epilogue="shared", cluster=2),
               GemmConfig(128, 128, 64, 6, 128, 8, epilogue="shared", cluster=2),
               # ... and 4-way B multicast (1000^3's 8 M tiles in two clusters of 4): a quarter of B's bytes
               GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared", cluster=4),
               GemmConfig(128, 64, 64, 6, 128, 8, epilogue="shared", cluster=4),
               # 64-row tiles (16 x 8 = 128 CTAs) with their 16 KiB B tile multicast: L2 bytes of 128x128/cluster2
               GemmConfig(64, 128, 64, 6, 128, 8, epilogue="shared", cluster=2),
               GemmConfig(64, 128, 64, 6, 128, 8, epilogue="shared", cluster=4),
               GemmConfig(64, 128, 64, 4, 128, 8, epilogue="shared", cluster=2),
               GemmConfig(64, 128, 64, 8, 128, 8, epilogue="shared", cluster=2),
               GemmConfig(64, 128, 64, 5, 128, 8, epilogue="shared", cluster=2),
               GemmConfig(64, 128, 64, 7, 128, 8, epilogue="shared", cluster=2),
               GemmConfig(64, 128, 128, 3, 128, 8, epilogue="shared", cluster=2),
               GemmConfig(64, 128, 64, 6, 128, 8, epilogue="shared", cluster_n=2),  # A's 8 KiB multicast instead
               # 2-D clusters (cuBLAS's 1000^3 kernel runs 4x2): B multicast along M, A along N
               GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared", cluster=2, cluster_n=2),
               GemmConfig(128, 128, 64, 6, 128, 8, epilogue="shared", cluster=2, cluster_n=2),
               GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared", cluster=4, cluster_n=2),
               GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared", cluster=2, cluster_n=4),
               GemmConfig(64, 128, 64, 6, 128, 8, epilogue="shared", cluster=4, cluster_n=2),
               GemmConfig(128, 64, 64, 6, 128, 8, epilogue="shared", cluster=2, cluster_n=4),
               GemmConfig(64, 128, 64, 8, 128, 8, epilogue="shared", cluster=4, cluster_n=2),
               GemmConfig(64, 128, 64, 6, 256, 8, "full_col", epilogue="shared", cluster=4, cluster_n=2),
               GemmConfig(128, 64, 64, 6, 256, 8, epilogue="shared", cluster=2, cluster_n=4),
               # split-K decode (16x8192x8192: 64 tiles of 64x128 -> 128 / 256 CTAs; 128 tiles of 64x64 -> 256)
               GemmConfig(64, 128, 64, 6, 128, 0, split_k=2), GemmConfig(64, 128, 64, 6, 128, 0, split_k=4),
               GemmConfig(64, 64, 128, 6, 128, 0, split_k=2), GemmConfig(64, 64, 128, 3, 128, 0, split_k=2),
               # decode, wider B rows per CTA (512 B per k row) and more CTAs streaming B
               GemmConfig(64, 256, 64, 4, 128, 0), GemmConfig(64, 256, 64, 4, 128, 0, split_k=4),
               GemmConfig(64, 64, 64, 8, 128, 0), GemmConfig(64, 128, 64, 8, 128, 0, split_k=2),
               # 1000^3: two consumer warpgroups on the 64 tiles of 128x128
               GemmConfig(128, 128, 64, 4, 256, 8, epilogue="shared"),
               # clusters of 2 neighbouring M tiles: B's tile multicast, half the B bytes from L2 per CTA
               GemmConfig(128, 256, 64, 3, 256, 8, epilogue="shared", cluster=2),
               GemmConfig(128, 256, 64, 3, 256, 0, epilogue="shared", cluster=2),
               GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared", cluster=2),
               # ping-pong: two consumer warpgroups on alternate tiles, one's epilogue under the other's loop
               GemmConfig(64, 256, 64, 4, 128, 8, epilogue="shared", pingpong=True),
               GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared", pingpong=True),
               GemmConfig(128, 128, 64, 5, 128, 8, pingpong=True),
               # stream-K: the last wave's tiles split along K in-kernel (1000^3: 64 tiles of 128x128 in halves,
               # or 32 of 128x256 in quarters; decode: 32 tiles of 64x256 in quarters)
               GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared", stream_k=2),
               GemmConfig(128, 128, 64, 6, 128, 8, epilogue="shared", stream_k=2),
               GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared", cluster=2, stream_k=2),
               GemmConfig(128, 256, 64, 3, 256, 8, epilogue="shared", stream_k=4),
               GemmConfig(64, 256, 64, 4, 128, 0, stream_k=4),
               # mid grids (1536x2048x2048: 192 tiles of 128x128, 1.45 waves): 128x192 tiles fill one wave
               # (132); stream-K splits the partial last wave of the paired 128x128 default instead
               GemmConfig(128, 192, 64, 4, 256, 8, epilogue="shared"), GemmConfig(128, 192, 64, 5, 256, 8),
               GemmConfig(128, 192, 64, 4, 256, 0, epilogue="shared", cluster=2),
               GemmConfig(128, 128, 64, 6, 128, 0, epilogue="shared", cluster=2, stream_k=2),
               # cuBLAS's 1000^3 tile in our frame: swapped 72x128, A and B multicast, C^T staged (2x2 clusters);
               # not in the tuner's space: a tuned config serves every layout, and A stored transposed refuses it
               GemmConfig(72, 128, 64, 8, 256, 0, epilogue="shared", cluster=2, cluster_n=2, swap_ab=True)],
}
# issue 4's bars for the sm_90a path, over each dtype's rows with B stored K x N: (what, shapes, reduction, bar)
TARGETS = [("geomean of 4096^3, 8192^3, 8192x1024x8192, 4096x14336x4096", LARGE_SHAPES, "geomean", 1.00),
           ("lowest of those four", LARGE_SHAPES, "min", 0.95),
           ("2048^3", [(2048, 2048, 2048)], "min", 0.95),
           ("lowest of 1000^3 and the ragged shapes", RAGGED_SHAPES, "min", 0.90),
           ("decode 16x8192x8192", [DECODE], "min", 1.00)]
TOLERANCE = {"float16": 5e-3, "bfloat16": 1e-2}  # relative Frobenius error vs float64
PATHS = {"sm_90a": "TMA + wgmma, warp-specialized", "sm_90": "Ampere-class: cp.async + mma.sync"}


def config_name(cfg):
    return (f"{cfg.block_M}x{cfg.block_N}x{cfg.block_K}/s{cfg.num_stages}/t{cfg.threads}"
            + (f"/k{cfg.split_k}" if cfg.split_k > 1 else "") + (f"/sk{cfg.stream_k}" if cfg.stream_k else "") + ("/tma-store" if cfg.epilogue == "shared" else "")
            + (f"/cluster{cfg.cluster}" if cfg.cluster * cfg.cluster_n > 1 else "")
            + (f"x{cfg.cluster_n}" if cfg.cluster_n > 1 else "") + ("/pingpong" if cfg.pingpong else "")
            + ("/swap" if cfg.swap_ab else "") + (f"/{cfg.policy}" if cfg.policy != "square" else "")
            + ("/no-raster" if not cfg.swizzle else "" if cfg.swizzle == 8 else f"/raster{cfg.swizzle}")
            + ("/b-evict-first" if cfg.b_evict_first else ""))


def target_lines(rows, dtype="float16") -> list:
    """Where the ``dtype`` ratios to cuBLAS stand against ``TARGETS``, a line each; a target none of whose
    shapes ran is left out, one with only some of them says so."""
    ratio = {r["shape"]: r["vs_cuBLAS"] for r in rows if r["dtype"] == dtype}
    lines = []
    for what, shapes, how, bar in TARGETS:
        got = [ratio[k] for k in ("x".join(map(str, s)) for s in shapes) if k in ratio]
        if not got:
            continue
        # a shape where no config was correct has ratio 0 (geometric_mean refuses it): the target is not met
        value = statistics.geometric_mean(got) if how == "geomean" and min(got) > 0 else min(got)
        partial = "" if len(got) == len(shapes) else f" (only {len(got)} of its {len(shapes)} shapes ran)"
        partial += "" if min(got) > 0 else " (a shape had no correct kernel)"
        lines.append(f"{what}: {value:.3f}, target >= {bar:.2f}: {'met' if value >= bar else 'NOT met'}{partial}")
    return lines


def other_shapes(spec):
    """The --shapes not in the table (ragged ones, say), benchmarked in fp16."""
    table = {"x".join(map(str, s)) for shapes in SHAPES.values() for s in shapes}
    return [tuple(map(int, s.split("x"))) for s in (spec or "").split(",") if s and s not in table]


def kernels_for(M, N, K, dtype, trans_B, configs, arch):
    """{config: kernel}; build_gemm: a split-K config is two kernels (partials, reduction) launched as one, and
    operands whose rows TMA cannot load are padded by pad_rows kernels launched with it.
    A config the shape does not allow (a cluster not dividing the M tiles) is said and left out."""
    out = {}
    for cfg in configs:
        try:
            out[cfg] = build_gemm(M, N, K, 1, 1, 1, False, trans_B, False, dtype, dtype, cfg, target=arch)
        except ValueError as e:
            sys.stderr.write(f"{M}x{N}x{K} {dtype} {config_name(cfg)}: {e}\n")  # one write: built in threads
    return out


def checked_tflops(fn, ref, tolerance, tflops, name):
    """TFLOP/s of an anchor's ``fn()`` (which returns its output), timed only after that output is checked
    against the float64 ``ref``: "WRONG" (said on stderr, with the error) when it is not within ``tolerance``."""
    e = ((fn().double() - ref).norm() / ref.norm()).item()
    if not e < tolerance:
        print(f"WRONG {name}: relative error {e:.1e}", file=sys.stderr)
        return "WRONG"
    return round(tflops(bench_ms(fn)), 1)


def tilelang_best(a, b, ref, dt, tflops):
    """TFLOP/s of TileLang's best correct config for this problem, or "-" when none builds or is correct."""
    M, K = a.shape
    best = "-"
    for cfg, kernel in tilelang_matmul.kernels(M, b.shape[1], K, dt).items():
        t = checked_tflops(lambda: kernel(a, b), ref, TOLERANCE[dt], tflops, f"tilelang {dt} {M}x{b.shape[1]}x{K} {cfg}")
        if t != "WRONG":
            best = t if best == "-" else max(best, t)
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default=default_arch(), choices=sorted(PATHS))
    p.add_argument("--no-triton", action="store_true")
    p.add_argument("--configs", action="store_true", help="also time a few block configs, report the best")
    p.add_argument("--config-filter", help="with --configs: only the extra configs whose name contains this (or one of a|b|...)")
    p.add_argument("--config-exclude", help="with --configs: leave out the extra configs whose name contains this")
    p.add_argument("--shapes", help="comma-separated MxNxK: only these of the table's shapes")
    p.add_argument("--tilelang", action="store_true", help="add TileLang's 20-line GEMM (needs tilelang)")
    p.add_argument("--compile-only", action="store_true",
                   help="build the kernels into the tile_ops cache and stop (no GPU needed): with "
                        "TILE_OPS_CACHE_DIR carried to the GPU, a run there needs no TVM")
    p.add_argument("--json")
    p.add_argument("--png")
    args = p.parse_args()
    args.png = png_path_or_none(args.png)
    jobs = [(M, N, K, dt, False) for dt, shapes in SHAPES.items() for (M, N, K) in pick_shapes(shapes, args.shapes)]
    jobs += [(*s, "float16", False) for s in other_shapes(args.shapes)]
    jobs += [(*s, "float16", True) for s in pick_shapes(TRANSPOSED_B, args.shapes)]
    extra = [c for c in EXTRA_CONFIGS[args.arch] if (not args.config_filter or any(
        f in config_name(c) for f in args.config_filter.split("|")))
             and not (args.config_exclude and args.config_exclude in config_name(c))] if args.configs else []
    configs = {job: list(dict.fromkeys([default_config(*job[:3], args.arch)] + [
        c for c in extra if c.split_k == 1 or job[0] * job[1] <= 1024 * 1024]))
        for job in jobs}  # split K: short grids
    with cf.ThreadPoolExecutor(os.cpu_count()) as pool:  # compile everything up front, in parallel
        built = dict(zip(jobs, pool.map(lambda j: kernels_for(*j, configs[j], args.arch), jobs)))
    if args.compile_only:
        print(f"built {sum(map(len, built.values()))} kernels for {args.arch}")
        return
    if args.tilelang and tilelang_matmul.available():
        print(f"--tilelang: no TileLang column ({tilelang_matmul.available()})", file=sys.stderr)
        args.tilelang = False
    rows = []
    for (M, N, K, dt, trans_B) in jobs:
        torch_dt = getattr(torch, dt)
        a = torch.randn(M, K, dtype=torch_dt, device="cuda")
        stored_b = torch.randn(*((N, K) if trans_B else (K, N)), dtype=torch_dt, device="cuda")
        b = stored_b.t() if trans_B else stored_b  # (K, N), strided where B^T is stored
        c = torch.empty(M, N, dtype=torch_dt, device="cuda")
        tflops = lambda ms: 2 * M * N * K / ms / 1e9  # noqa: E731
        ref = (a.double() @ b.double())
        ptrs = [a.data_ptr(), stored_b.data_ptr(), c.data_ptr(), c.data_ptr()]  # A, B, (bias), C

        def check(k):
            c.fill_(float("nan"))
            k.launch_ptrs(ptrs, a.device)
            return ((c.double() - ref).norm() / ref.norm()).item()

        job = (M, N, K, dt, trans_B)
        ms, err, best_cfg = fastest_correct(built[job], check, lambda k: k.launch_ptrs(ptrs, a.device),
                                            TOLERANCE[dt], lambda cfg: f"{dt} {M}x{N}x{K} {config_name(cfg)}",
                                            lambda ms: f"{tflops(ms):.1f} TFLOP/s")
        if best_cfg is None:
            best, cublas = 0.0, tflops(bench_ms(lambda: torch.matmul(a, b)))
        else:  # the winner and cuBLAS call by call in turn (common.paired_medians): drift hits both alike
            k = built[job][best_cfg]
            paired = paired_medians({"ours": lambda: k.launch_ptrs(ptrs, a.device), "cuBLAS": lambda: torch.matmul(a, b)})
            best, cublas = tflops(paired["ours"]), tflops(paired["cuBLAS"])
        row = {"dtype": dt, "shape": f"{M}x{N}x{K}" + (" B^T" if trans_B else ""), "tile_ops": round(best, 1),
               "cuBLAS": round(cublas, 1), "vs_cuBLAS": round(best / cublas, 3), "rel_err": "-" if err is None else f"{err:.1e}",
               "config": "NONE CORRECT" if best_cfg is None else config_name(best_cfg)}
        if not args.no_triton:  # the Triton and TileLang anchors take a row-major B only
            from triton_matmul import matmul as triton_matmul

            row["triton"] = "-" if trans_B else checked_tflops(lambda: triton_matmul(a, b), ref, TOLERANCE[dt], tflops,
                                                               f"triton {dt} {M}x{N}x{K}")
        if args.tilelang:
            row["tilelang"] = "-" if trans_B else tilelang_best(a, b, ref, dt, tflops)
        rows.append(row)
        del a, b, stored_b, c, ref
    cols = ["dtype", "shape", "tile_ops", "cuBLAS"] + ([] if args.no_triton else ["triton"]) + (
        ["tilelang"] if args.tilelang else []) + [
        "vs_cuBLAS", "rel_err", "config"]
    print_table(rows, cols, f"GEMM TFLOP/s on {torch.cuda.get_device_name()} (tile_ops {args.arch}: {PATHS[args.arch]})")
    for dt in SHAPES if args.arch == "sm_90a" else ():
        if lines := target_lines(rows, dt):
            print(f"\nIssue 4's targets ({dt}, tile_ops vs cuBLAS):\n  " + "\n  ".join(lines))
    save(rows, args.json, args.png, x=("dtype", "shape"), ys=("tile_ops", "cuBLAS", "triton", "tilelang"),
         ylabel="TFLOP/s")


if __name__ == "__main__":
    main()
