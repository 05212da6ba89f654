"""Several GEMM configs of ours beside cuBLAS at the same shapes, all timed call by call in one loop.

    python benchmarks/compare_configs.py --configs NAME[,NAME...] [--shapes MxNxK,...] [--dtype float16]
                                         [--rounds 2] [--json FILE]

NAMEs are bench_gemm.py's config names (``64x128x64/s8/t128/tma-store/cluster2``, ``.../full_col``) or
``default`` (the library's default for the shape). Each config is checked against float64 first (a wrong
one, or one the shape refuses, is reported and not timed); then every config and cuBLAS run in turn, each
call after the same L2 flush (``common.paired_medians``), so clock and power drift hit all of them alike:
the ratios compare kernels, not moments. bench_gemm.py times configs one after the other and pairs only
the winner.

Each round is a process of its own (a short grid's speed is drawn per process and kept within it); the table
gives every process's ratio to cuBLAS and their median.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from profile_gemm import parse_config


def run_round(shapes, names, dtype, rep_ms):
    """One process's medians: [{shape, config, us, vs_cuBLAS}] (None where a config was wrong or refused)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from bench_gemm import kernels_for
    from common import paired_medians, passing

    from tile_ops.kernels.gemm_config import GemmConfig
    from tile_ops.kernels.gemm_defaults import default_config

    rows = []
    for M, N, K in shapes:
        cfgs = {n: default_config(M, N, K, "sm_90a") if n == "default" else parse_config(n, GemmConfig)
                for n in names}
        with ThreadPoolExecutor(os.cpu_count()) as pool:  # built in parallel; a config the shape refuses is said
            built = dict(zip(names, pool.map(lambda n: kernels_for(M, N, K, dtype, False, [cfgs[n]], "sm_90a"),
                                             names)))
        dt = getattr(torch, dtype)
        a, b = torch.randn(M, K, dtype=dt, device="cuda"), torch.randn(K, N, dtype=dt, device="cuda")
        ref = a.double() @ b.double()

        def launcher(k):  # a launch into an output of its own, which it returns (NaN before the first)
            c = torch.full((M, N), float("nan"), dtype=dt, device="cuda")
            return lambda: (k.launch_ptrs([a.data_ptr(), b.data_ptr(), c.data_ptr(), c.data_ptr()], a.device), c)[1]

        launches = {n: launcher(k[cfgs[n]]) for n, k in built.items() if k}
        ok = passing(launches, lambda launch: ((launch().double() - ref).norm() / ref.norm()).item(), 5e-3,
                     lambda n: f"{M}x{N}x{K} {n}")
        ms = paired_medians({"cuBLAS": lambda: torch.matmul(a, b), **{n: launch for n, (launch, _) in ok.items()}},
                            rep_ms=rep_ms)
        rows += [{"shape": f"{M}x{N}x{K}", "config": name, "us": round(ms[name] * 1e3, 2) if name in ms else None,
                  "vs_cuBLAS": round(ms["cuBLAS"] / ms[name], 3) if name in ms else None}
                 for name in ["cuBLAS", *names]]
    return rows


def summary(rounds):
    """[{shape, config, per-process ratios, median ratio, median µs}] over the rounds."""
    table = {}
    for rows in rounds:
        for r in rows:
            table.setdefault((r["shape"], r["config"]), []).append(r)
    med = lambda xs: round(statistics.median(xs), 3) if xs else "-"  # noqa: E731
    return [{"shape": shape, "config": config,
             "per_process": " ".join("-" if r["vs_cuBLAS"] is None else f"{r['vs_cuBLAS']:.3f}" for r in rs),
             "median": med([r["vs_cuBLAS"] for r in rs if r["vs_cuBLAS"] is not None]),
             "us": med([r["us"] for r in rs if r["us"] is not None])}
            for (shape, config), rs in table.items()]


def parse_args(argv=None):
    """The arguments, with every config name and shape checked before any GPU work."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", required=True, help="comma-separated config names (bench_gemm.py's), or default")
    p.add_argument("--shapes", default="1000x1000x1000,1000x1000x4000", help="comma-separated MxNxK")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    p.add_argument("--rounds", type=int, default=2, help="processes, each timing every config")
    p.add_argument("--rep-ms", type=int, default=1500, help="paired timing per shape and process")
    p.add_argument("--json")
    p.add_argument("--child-out", help=argparse.SUPPRESS)  # a round's process: its rows go to this file
    args = p.parse_args(argv)
    from tile_ops.kernels.gemm_config import GemmConfig

    args.names = list(dict.fromkeys(["default"] + [n for n in args.configs.split(",") if n]))
    for name in args.names[1:]:
        try:
            parse_config(name, GemmConfig)
        except (ValueError, TypeError) as e:
            p.error(f"--configs: {e}")
    try:
        args.shape_list = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    except ValueError:
        args.shape_list = []
    if not args.shape_list or any(len(s) != 3 or min(s) < 1 for s in args.shape_list):
        p.error(f"--shapes {args.shapes!r}: accepted: comma-separated MxNxK of positive integers (1000x1000x4000)")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("compare_configs.py times kernels on a CUDA GPU; this machine has none")
    if args.child_out:
        with open(args.child_out, "w") as f:
            json.dump(run_round(args.shape_list, args.names, args.dtype, args.rep_ms), f)
        return
    from common import print_table

    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            out = os.path.join(tmp, f"round{i}.json")
            child = [sys.executable, os.path.abspath(__file__), "--configs", args.configs, "--shapes", args.shapes,
                     "--dtype", args.dtype, "--rep-ms", str(args.rep_ms), "--child-out", out]
            rc = subprocess.run(child).returncode  # its stderr (refused or wrong configs) shows as it goes
            if rc or not os.path.exists(out):
                print(f"compare_configs.py: round {i + 1} failed (exit status {rc})", file=sys.stderr)
                break
            with open(out) as f:
                rounds.append(json.load(f))
            if args.json:  # what has run so far survives a timeout
                with open(args.json, "w") as f:
                    json.dump({"rounds": rounds, "rows": summary(rounds)}, f, indent=1)
    if rounds:
        print_table(summary(rounds), ["shape", "config", "per_process", "median", "us"],
                    f"{args.dtype}, ours / cuBLAS paired call by call, {len(rounds)} processes (median µs)")
    if len(rounds) < args.rounds:
        sys.exit(1)


if __name__ == "__main__":
    main()
