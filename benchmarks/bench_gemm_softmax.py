"""Fused GEMM+softmax vs torch's softmax(a @ b) (fp16, and with an fp32 softmax), microseconds, one run.

    python benchmarks/bench_gemm_softmax.py [--configs [--config-filter S]] [--parts] [--parts-filter S]
                                            [--shapes MxNxK,...] [--json out.json] [--png out.png]

``--configs`` also times a few other configs of the fused kernel (each checked against float64 first) and
reports the fastest; the table's ``config`` column names it.  ``--parts`` adds, for the reported config,
the kernel without its normalization (the final rescale pass, or the cluster exchange) and without its
softmax math too (``gemm_softmax(parts=...)``): where the fused kernel's time goes beyond its GEMM.
``--parts-filter S`` also prints (stderr) the parts of every other timed config whose name contains S.
``vs_anchor_torch`` is ../shared/ANCHORS.md's torch time for the shape over ours (issue 4 asks for 2.5x);
``speedup_vs_torch`` is against torch timed in the same run: the reported fused config and torch's
``softmax(scale * (a @ b))`` are timed call by call in turn, medians (``fused_us``, ``torch_us``).
"""

import argparse
import concurrent.futures as cf
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import bench_ms, fastest_correct, paired_medians, pick_shapes, png_path_or_none, print_table, save  # noqa: E402

from tile_ops.kernels.gemm_defaults import default_config as gemm_config  # noqa: E402
from tile_ops.kernels.gemm_launch import build_gemm  # noqa: E402
from tile_ops.kernels.gemm_softmax import LOG2E, gemm_softmax  # noqa: E402
from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig  # noqa: E402
from tile_ops.kernels.gemm_softmax_defaults import default_config  # noqa: E402
from tile_ops.kernels.gemm_softmax_launch import build_gemm_softmax, gemm_softmax_call  # noqa: E402

SHAPES = [(4096, 4096, 4096), (8192, 2048, 1024), (16384, 1024, 512), (4096, 64, 512), (2048, 8192, 256)]
# torch's softmax(a @ b) in fp16, µs, as ../shared/ANCHORS.md measured it on our H200 (issue 4's 2.5x is against it)
ANCHOR_TORCH_US = {(4096, 4096, 4096): 285, (8192, 2048, 1024): 192, (16384, 1024, 512): 153}
SCALE = 0.125
TOLERANCE = 5e-3
EXTRA_CONFIGS = [  # wider column tiles (m64n256 wgmma), 128-row tiles, deeper or longer K steps
    SoftmaxConfig(64, 256, 64, 3, 128), SoftmaxConfig(64, 256, 64, 2, 128), SoftmaxConfig(128, 128, 64, 3, 256),
    SoftmaxConfig(128, 256, 64, 2, 256), SoftmaxConfig(64, 128, 64, 6, 128), SoftmaxConfig(64, 128, 128, 3, 128),
    # two consumer warpgroups splitting each 64-row tile's columns (wgmma along N)
    SoftmaxConfig(64, 256, 64, 3, 256, "full_col"), SoftmaxConfig(64, 128, 64, 4, 256, "full_col"),
    # a row block's columns split over a thread-block cluster: one tile per block, or a short walk each
    *[SoftmaxConfig(128, 256, 64, 3, 256, "full_row", split) for split in (2, 4, 8)],
    *[SoftmaxConfig(128, 256, 64, 3, 256, "full_row", split, persistent=False) for split in (4, 8)],
    # two consumer warpgroups per CTA on alternate 64-row blocks: one's softmax under the other's GEMM
    *[SoftmaxConfig(64, 256, 64, stages, 128, "full_row", 8, pingpong=True) for stages in (3, 4)],
    SoftmaxConfig(64, 256, 64, 3, 128, "full_row", 4, pingpong=True),
    # 64-row blocks, the two warpgroups splitting each tile's columns: 128 row blocks quantize to 4.5 rounds
    # of the 15 clusters of 8 instead of 5, but a 64-row tile is slower per FLOP: it brings more bytes into the SM
    # per FLOP (92 against 78 us at 8192x2048x1024 on the H200)
    *[SoftmaxConfig(64, 256, 64, stages, 256, "full_col", 8) for stages in (3, 4)],
    SoftmaxConfig(128, 128, 64, 4, 256, "full_row", 8), SoftmaxConfig(64, 256, 64, 4, 128, "full_row", 8),
    SoftmaxConfig(64, 128, 64, 4, 128, "full_row", 8),
    # stream-K: the last round's row blocks split along K over the idle clusters (64 on 15: 4 in 3 parts)
    *[SoftmaxConfig(128, 256, 64, 3, 256, "full_row", 8, stream_k=parts) for parts in (2, 3)],
    # a row's tiles over the whole grid (no cluster: all 132 SMs), statistics exchanged through global memory
    SoftmaxConfig(128, 256, 64, 3, 256, "full_row", deferred=True),
    *[SoftmaxConfig(128, 128, 64, stages, 256, "full_row", deferred=True) for stages in (4, 5)],
]


def config_name(c):
    return f"{c.block_M}x{c.block_N}x{c.block_K}/s{c.num_stages}/t{c.threads}" + (
        f"/{c.policy}" if c.policy != "square" else "") + (f"/cluster{c.split}" if c.split > 1 else "") + (
        "" if c.persistent else "/nonpersistent") + ("/pingpong" if c.pingpong else "") + (
        f"/sk{c.stream_k}" if c.stream_k else "") + ("/deferred" if c.deferred else "")


def build(shape, configs):
    """{config: kernel} for the configs that compile for this shape (a failure is said, not fatal)."""
    out = {}
    for c in configs:
        try:
            out[c] = build_gemm_softmax(*shape, SCALE, "float16", "float16", c)  # as the op: M at run time
        except Exception as e:  # noqa: BLE001 - e.g. too much shared memory for this N
            print(f"{shape} {config_name(c)}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
    return out


def time_parts(shape, cfg, a, b, out):
    """Microseconds of ``cfg``'s kernel without the final rescale pass, and without the softmax math too
    (that one is checked: it stores the scaled log2-unit scores)."""
    args, kwargs = gemm_softmax_call(*shape, SCALE, "float16", "float16", cfg)
    no_rescale = gemm_softmax(*args, **kwargs, parts="no_rescale")
    scores = gemm_softmax(*args, **kwargs, parts="gemm")
    out.fill_(float("nan"))
    scores.launch(a, b, out)
    want = SCALE * LOG2E * (a.double() @ b.double())
    err = ((out.double() - want).norm() / want.norm()).item()
    if not err < TOLERANCE:
        print(f"WRONG parts=gemm {shape} {config_name(cfg)}: relative error {err:.1e}", file=sys.stderr)
    return {"no_rescale_us": round(bench_ms(lambda: no_rescale.launch(a, b, out)) * 1e3, 1),
            "gemm_part_us": round(bench_ms(lambda: scores.launch(a, b, out)) * 1e3, 1)}


def check_gemm_alone(launch, out, a, b):
    """The ``our_gemm`` column is the bar the fused kernel is held to (within 1.3x): a wrong gemm is no bar."""
    out.fill_(float("nan"))
    launch()
    ref = a.double() @ b.double()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    if not err < TOLERANCE:
        raise SystemExit(f"bench_gemm_softmax: our gemm alone is wrong at {tuple(out.shape)}x{a.shape[1]} "
                         f"(relative error {err:.1e})")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", action="store_true", help="also time a few other fused configs, report the best")
    p.add_argument("--parts", action="store_true", help="also time the reported config without its rescale pass "
                                                         "and without its softmax math")
    p.add_argument("--parts-filter", help="with --parts: also the parts of the configs whose name contains this (or one of a|b|...)")
    p.add_argument("--config-filter", help="with --configs: only the extra configs whose name contains this (or one of a|b|...)")
    p.add_argument("--shapes", help="comma-separated MxNxK: only these of the table's shapes")
    p.add_argument("--json")
    p.add_argument("--png")
    args = p.parse_args()
    args.png = png_path_or_none(args.png)
    shapes = pick_shapes(SHAPES, args.shapes)
    extra = [c for c in EXTRA_CONFIGS if not args.config_filter or any(
        f in config_name(c) for f in args.config_filter.split("|"))] if args.configs else []
    with cf.ThreadPoolExecutor(os.cpu_count()) as pool:
        fused = list(pool.map(lambda s: build(s, list(dict.fromkeys([default_config(*s)] + extra))), shapes))
        plain = list(pool.map(lambda s: build_gemm(*s, cfg=gemm_config(*s)), shapes))  # what the op launches
    rows = []
    for (M, N, K), kernels, kg in zip(shapes, fused, plain):
        a = torch.randn(M, K, dtype=torch.float16, device="cuda")
        b = torch.randn(K, N, dtype=torch.float16, device="cuda")
        out = torch.empty(M, N, dtype=torch.float16, device="cuda")
        ref = torch.softmax(SCALE * (a.double() @ b.double()), -1)

        def check(kf):
            out.fill_(float("nan"))
            kf.launch(a, b, out)
            return ((out.double() - ref).norm() / ref.norm()).item()

        ms, err, best = fastest_correct(kernels, check, lambda kf: kf.launch(a, b, out), TOLERANCE,
                                        lambda cfg: f"{M}x{N}x{K} {config_name(cfg)}", lambda ms: f"{ms * 1e3:.1f} us")
        torch_fn = lambda: torch.softmax(SCALE * (a @ b), -1)  # noqa: E731
        if best is not None:  # the winner and torch call by call in turn, medians (common.paired_medians)
            paired = paired_medians({"fused": lambda: kernels[best].launch(a, b, out), "torch": torch_fn})
            t_fused, t_torch = paired["fused"] * 1e3, paired["torch"] * 1e3
        else:
            t_fused, t_torch = ms * 1e3, bench_ms(torch_fn) * 1e3
        gemm_alone = lambda: kg.launch_ptrs([a.data_ptr(), b.data_ptr(), out.data_ptr(), out.data_ptr()], a.device)  # noqa: E731
        check_gemm_alone(gemm_alone, out, a, b)
        t_gemm = bench_ms(gemm_alone) * 1e3
        t_torch32 = bench_ms(lambda: torch.softmax(SCALE * (a @ b).float(), -1).half()) * 1e3
        t_mm = bench_ms(lambda: a @ b) * 1e3
        if args.parts and best is not None:
            parts_us = time_parts((M, N, K), best, a, b, out)
            for cfg in kernels if args.parts_filter else ():
                if cfg != best and any(f in config_name(cfg) for f in args.parts_filter.split("|")):
                    print(f"{M}x{N}x{K} {config_name(cfg)} parts: {time_parts((M, N, K), cfg, a, b, out)}",
                          file=sys.stderr)
        rows.append({"shape": f"{M}x{N}x{K}", "fused_us": round(t_fused, 1), "our_gemm_us": round(t_gemm, 1),
                     "torch_us": round(t_torch, 1), "torch_fp32sm_us": round(t_torch32, 1),
                     "cublas_mm_us": round(t_mm, 1), "speedup_vs_torch": round(t_torch / t_fused, 2),
                     "vs_anchor_torch": round(ANCHOR_TORCH_US[(M, N, K)] / t_fused, 2)
                     if (M, N, K) in ANCHOR_TORCH_US else "-",
                     "fused/our_gemm": round(t_fused / t_gemm, 2), "rel_err": "-" if err is None else f"{err:.1e}",
                     "config": "NONE CORRECT" if best is None else config_name(best)})
        if args.parts and best is not None:
            rows[-1].update(parts_us)
        del a, b, out, ref
    print_table(rows, list(rows[0]), f"GEMM+softmax (fp16) on {torch.cuda.get_device_name()}")
    save(rows, args.json, args.png, ys=("fused_us", "torch_us", "torch_fp32sm_us"), ylabel="microseconds")


if __name__ == "__main__":
    main()
