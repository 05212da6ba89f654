"""Our GEMM beside cuBLAS by the L2's state before each call, by where the flush buffer and the operands sit,
and by the L2 fill size our tensor maps ask for: what a short ragged grid's ratio depends on.

    python benchmarks/l2_state.py [--shapes 1000x1000x1000,1024x1024x1024] [--config NAME]
                                  [--states dirty,clean,warm] [--flushes 3] [--operand-sets 2]
                                  [--promotions compiled,none,64,128,256,A:none+B:128] [--ms 300]
                                  [--compile-only]

bench_gemm.py flushes the L2 before each timed call as Triton's do_bench does: it zeroes a 256 MB buffer,
which leaves the L2 full of dirty lines that the timed kernel's misses must write back first.  At 1000^3
(2000-byte rows) our kernel lost 1.2 us to that in one process and nothing in another (H200), so
bench_gemm.py's 1000^3 ratio is partly a draw.  Each row here is one (operand set, flush buffer, state):

- state: ``dirty`` (bench_gemm.py's flush), ``clean`` (the same, then a 256 MB read, which leaves clean
  lines), ``warm`` (no flush; a ~50 us sleep kernel ahead instead, so the host's launch stays off the clock);
- flush buffer: one of ``--flushes`` 256 MB buffers, all allocated up front (each on its own pages);
- operand set: one of ``--operand-sets`` allocations of A, B and C (fresh random values each).

Its columns are cuBLAS and our kernel (the default config, or ``--config``, a bench_gemm.py config name)
launched with tensor maps that ask for each of ``--promotions``: ``compiled`` (what compiler/sm90.py's
``l2_promotion`` chose), ``none``/``64``/``128``/``256`` for every tensor map, or per operand
(``A:none+B:128``; the others as compiled).  Every promotion launches the same cubin.  A row's kernels are
timed call by call in turn (``common.paired_medians``): microseconds, then each one's ratio to cuBLAS.
``--compile-only`` fills the kernel cache (no GPU needed) for a run without TVM.
"""

import argparse
import dataclasses
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import l2_flusher, paired_medians, print_table  # noqa: E402
from profile_gemm import parse_config  # noqa: E402

from tile_ops.jit.kernel import Kernel, Sized  # noqa: E402
from tile_ops.kernels.gemm_config import GemmConfig  # noqa: E402
from tile_ops.kernels.gemm_defaults import default_config  # noqa: E402
from tile_ops.kernels.gemm_launch import build_gemm  # noqa: E402

PROMOTIONS = {"none": 0, "64": 1, "128": 2, "256": 3}  # CUtensorMapL2promotion
STATES = ("dirty", "clean", "warm")
TOLERANCE = 5e-3  # fp16, relative Frobenius error against float64 (bench_gemm.py's)
WARM_SLEEP_CYCLES = 100_000  # ~50 us at the H200's clocks: the host's next launches queue behind it


def parse_promotion(spec: str, tensors) -> dict:
    """{tensor: CUtensorMapL2promotion} that ``spec`` overrides: {} for ``compiled``; every one of
    ``tensors`` for a bare fill size; the named ones for ``A:none+B:128``."""
    def value(v):
        if v not in PROMOTIONS:
            raise ValueError(f"--promotions {spec!r}: {v!r} is not an L2 fill size; accepted: "
                             f"{', '.join(PROMOTIONS)} (or 'compiled')")
        return PROMOTIONS[v]

    if spec == "compiled":
        return {}
    if ":" not in spec:
        return {t: value(spec) for t in tensors}
    out = {}
    for part in spec.split("+"):
        tensor, _, v = part.partition(":")
        if tensor not in tensors:
            raise ValueError(f"--promotions {spec!r}: {tensor!r} is no tensor this kernel loads through TMA; "
                             f"it has {', '.join(sorted(tensors)) or 'none'}")
        out[tensor] = value(v)
    return out


def with_l2_promotion(kernel, spec: str):
    """``kernel``'s cubin launched with the tensor maps ``spec`` (``parse_promotion``) asks for."""
    if isinstance(kernel, Sized):  # M at run time, bound
        return Sized(with_l2_promotion(kernel.launchable, spec), kernel.dims)
    if not isinstance(kernel, Kernel):
        if spec == "compiled":
            return kernel
        raise ValueError(f"--promotions {spec!r}: this config builds a {type(kernel).__name__} (split K or padded "
                         f"rows), several kernels; only 'compiled' is accepted for it")
    maps = kernel.meta.tensormaps
    override = parse_promotion(spec, {m["tensor"] for m in maps.values()})
    if not override:
        return kernel
    tensormaps = {name: {**m, "l2_promotion": override.get(m["tensor"], m["l2_promotion"])} for name, m in maps.items()}
    return Kernel(dataclasses.replace(kernel.meta, tensormaps=tensormaps), kernel.source, kernel.cubin)


def flushes(state: str, dirty, other):
    """The function run before each timed call in ``state``, from a ``dirty`` flush (l2_flusher's) and
    ``other``, a 256 MB buffer that is only read."""
    if state == "dirty":
        return dirty
    if state == "warm":
        return lambda: torch.cuda._sleep(WARM_SLEEP_CYCLES)

    def clean():
        dirty()
        other.sum(dtype=torch.int32)  # 256 MB of reads: the L2 left holding clean lines

    return clean


def operands(M, N, K):
    a = torch.randn(M, K, dtype=torch.float16, device="cuda")
    b = torch.randn(K, N, dtype=torch.float16, device="cuda")
    return a, b, torch.empty(M, N, dtype=torch.float16, device="cuda")


def checked(kernels: dict, a, b, c) -> dict:
    """``kernels`` ({name: kernel}) as {name: launch()}, each checked against float64 once first."""
    ref = a.double() @ b.double()
    ptrs = [a.data_ptr(), b.data_ptr(), c.data_ptr(), c.data_ptr()]  # A, B, (bias), C
    out = {}
    for name, k in kernels.items():
        c.fill_(float("nan"))
        k.launch_ptrs(ptrs, a.device)
        err = ((c.double() - ref).norm() / ref.norm()).item()
        if not err < TOLERANCE:
            raise SystemExit(f"WRONG {name}: relative error {err:.1e}")
        out[name] = lambda k=k: k.launch_ptrs(ptrs, a.device)
    return out


def rows_for(shape, cfg, args):
    M, N, K = shape
    base = build_gemm(M, N, K, 1, 1, 1, False, False, False, "float16", "float16", cfg, target="sm_90a")
    variants = {p: with_l2_promotion(base, p) for p in args.promotions}
    dirties = [l2_flusher() for _ in range(args.flushes)]  # all alive at once: each its own pages
    other = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if "clean" in args.states else None
    rows = []
    for s in range(args.operand_sets):
        a, b, c = operands(M, N, K)
        ours = checked(variants, a, b, c)
        for f, dirty in enumerate(dirties):
            for state in args.states:
                fns = {"cuBLAS": lambda: torch.matmul(a, b), **ours}
                us = {n: ms * 1e3 for n, ms in paired_medians(fns, args.ms, flush=flushes(state, dirty, other)).items()}
                row = {"shape": "x".join(map(str, shape)), "set": s, "flush": f, "state": state,
                       "cuBLAS": f"{us['cuBLAS']:.2f}"}
                for p in args.promotions:
                    row[p] = f"{us[p]:.2f}"
                    row[f"r {p}"] = round(us["cuBLAS"] / us[p], 3)
                rows.append(row)
                print(row, file=sys.stderr, flush=True)
    return rows


def summary(rows, promotions, states) -> list:
    """Per (shape, state): each promotion's median and lowest ratio to cuBLAS over the sets and flushes."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for state in states:
            sel = [r for r in rows if r["shape"] == shape and r["state"] == state]
            for p in promotions:
                ratios = [r[f"r {p}"] for r in sel]
                out.append({"shape": shape, "state": state, "promotion": p, "rows": len(ratios),
                            "median": round(statistics.median(ratios), 3), "lowest": round(min(ratios), 3)})
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1000x1000x1000,1024x1024x1024", help="comma-separated MxNxK (fp16)")
    p.add_argument("--config", help="a bench_gemm.py config name (default: each shape's default config)")
    p.add_argument("--states", default="dirty,clean", help=f"comma-separated of {', '.join(STATES)}")
    p.add_argument("--flushes", type=int, default=3, help="256 MB flush buffers, one row each")
    p.add_argument("--operand-sets", type=int, default=2, help="allocations of A, B, C, one row each")
    p.add_argument("--promotions", default="compiled,none,64,128,256")
    p.add_argument("--ms", type=float, default=300, help="milliseconds of paired calls per row")
    p.add_argument("--compile-only", action="store_true", help="build the kernels into the cache and stop")
    args = p.parse_args(argv)
    args.shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    args.states = args.states.split(",")
    args.promotions = args.promotions.split(",")
    bad = [s for s in args.states if s not in STATES]
    if bad or args.flushes < 1 or args.operand_sets < 1:
        p.error(f"--states takes {', '.join(STATES)} (got {bad}); --flushes and --operand-sets at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    configs = {s: parse_config(args.config, GemmConfig) if args.config else default_config(*s, "sm_90a")
               for s in args.shapes}
    if args.compile_only:
        for s, cfg in configs.items():
            k = build_gemm(*s, 1, 1, 1, False, False, False, "float16", "float16", cfg, target="sm_90a")
            for spec in args.promotions:  # the promotions parse against the kernel they will launch
                with_l2_promotion(k, spec)
        print(f"built {len(configs)} kernels for sm_90a")
        return
    rows = [r for s in args.shapes for r in rows_for(s, configs[s], args)]
    cols = ["shape", "set", "flush", "state", "cuBLAS"] + args.promotions + [f"r {p}" for p in args.promotions]
    print_table(rows, cols, f"µs and ratio to cuBLAS by L2 state, flush buffer and L2 promotion, on "
                            f"{torch.cuda.get_device_name()}")
    print_table(summary(rows, args.promotions, args.states), ["shape", "state", "promotion", "rows", "median",
                                                              "lowest"], "ratio to cuBLAS over sets and flushes")


if __name__ == "__main__":
    main()
