"""Nsight Compute counters of our GEMM beside cuBLAS's at one shape: where the gap comes from.

    python benchmarks/profile_gemm.py [--shape 4096x4096x4096] [--dtype float16] [--config NAME] [--stalls N]
                                      [--stalls-csv FILE] [--op gemm_softmax] [--l2-sources] [--l2 clean|dirty]

Runs itself under ``ncu --clock-control none`` (the card's clocks untouched), profiling every kernel of
the second call of ours and of cuBLAS (a cudaProfilerStart/Stop range), and prints per kernel: time, SM
clock, tensor-pipe (wgmma) utilization, SM, L1/shared and L2 throughput (% of peak), L2 and DRAM bytes,
warp instructions.  A loop that keeps neither the tensor pipe nor a memory unit busy waits on latency.  A clock below the other kernel's means power throttling; more L2 bytes for the same FLOPs means less
operand reuse; more instructions, spinning or index arithmetic.  ``--config`` takes bench_gemm.py's config names
(``128x128x64/s4/t128/sk2/tma-store/cluster2``); ``--stalls N`` also prints our kernel's N SASS
instructions with the most warp-stall samples (ncu's source view), and each kernel's (ours and cuBLAS's)
stall reasons per issued instruction: a loop whose warps mostly wait on data shows long_scoreboard, one
that waits on its own instructions wait/selected/math (``--stalls-csv``: the whole source view, every
instruction's samples by reason).
``--l2 dirty`` profiles the kernels as bench_gemm.py times them: each after a zeroed 256 MB buffer (Triton's
flush), whose dirty lines the kernel's misses must write back; ncu then leaves the caches alone and replays
the whole process for each pass.  The default (``clean``) lets ncu flush and invalidate the caches.
"""

import argparse
import csv
import io
import os
import re
import subprocess
import sys

METRICS = {
    "gpu__time_duration.sum": "time_us",
    "sm__cycles_elapsed.avg.per_second": "sm_clock_ghz",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": "gmma_active_%",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_%",
    "l1tex__throughput.avg.pct_of_peak_sustained_active": "l1_smem_%",  # the L1/shared unit's busiest part (SOL)
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2_%",
    "lts__t_bytes.sum": "l2_MB",
    "dram__bytes.sum": "dram_MB",
    "smsp__inst_executed.sum": "inst_M",  # warp instructions: spin loops show here (energy at the power cap)
    "launch__registers_per_thread": "regs",
    "launch__occupancy_limit_shared_mem": "ctas_by_smem",
}
# --l2-sources: where the L2's requests come from, in 32-byte sectors: the SMs (L1/TEX, TMA included) and the
# fabric between the two L2 partitions (a line the far partition holds is looked up in both); the SMs' reads
# the L2 served, against the bytes that arrived in the SMs: every CTA's whole tiles, a multicast counted in
# each receiver.  The L2 serves fewer: a multicast once, and (H100, 1024x1024x4096) reads of one line by several SMs
# at about the same time once too, so an unclustered 64x128 kernel's 201 MB arrived on 95 MB of L2 reads
L2_SOURCES = {"lts__t_sectors_srcunit_tex.sum": "l2_from_sm_MB", "lts__t_sectors_srcunit_ltcfabric.sum": "l2_fabric_MB",
              "lts__t_sectors_srcunit_tex_op_read.sum": "l2_reads_MB", "l1tex__m_xbar2l1tex_read_bytes.sum": "into_sms_MB"}
SCALE = {"time_us": 1e-3, "sm_clock_ghz": 1e-9, "l2_MB": 1e-6, "dram_MB": 1e-6, "inst_M": 1e-6,  # from ns, Hz, bytes,
         "l2_from_sm_MB": 32e-6, "l2_fabric_MB": 32e-6, "l2_reads_MB": 32e-6, "into_sms_MB": 1e-6}  # instructions, sectors


def parse_config(name, GemmConfig):
    """A GemmConfig from bench_gemm.py's ``config_name``: BMxBNxBK/sS/tT[/kK][/skP][/tma-store][/clusterC[xN]]
    [/pingpong][/swap][/full_col|/full_row][/no-raster|/rasterR][/b-evict-first].  A part it does not know is an error (a
    misspelt flag would otherwise time another kernel under the name given)."""
    parts = name.split("/")
    if len(parts) < 3 or not all(re.fullmatch(pattern, part) for pattern, part in
                                 zip((r"\d+x\d+x\d+", r"s\d+", r"t\d+"), parts)):
        raise ValueError(f"config name {name!r}: must start BMxBNxBK/sSTAGES/tTHREADS (e.g. 64x128x64/s8/t128)")
    tile, stages, threads, *flags = parts
    bm, bn, bk = map(int, tile.split("x"))
    kw = dict(swizzle=8, epilogue="direct", pingpong=False, swap_ab=False, policy="square")
    for f in flags:
        if f in _FLAGS:
            kw.update(_FLAGS[f])
        elif m := re.fullmatch(r"raster(\d+)", f):
            kw["swizzle"] = int(m[1])
        elif m := re.fullmatch(r"cluster(\d+)(?:x(\d+))?", f):
            kw["cluster"], kw["cluster_n"] = int(m[1]), int(m[2] or 1)
        elif m := re.fullmatch(r"(sk|k)(\d+)", f):
            kw["stream_k" if m[1] == "sk" else "split_k"] = int(m[2])
        else:
            raise ValueError(f"config name {name!r}: unknown part {f!r} (accepted: kK, skP, clusterC, clusterCxN, "
                             f"rasterR, {', '.join(_FLAGS)})")
    return GemmConfig(bm, bn, bk, int(stages[1:]), int(threads[1:]), **kw)


_FLAGS = {"tma-store": dict(epilogue="shared"), "pingpong": dict(pingpong=True), "swap": dict(swap_ab=True),
          "full_col": dict(policy="full_col"), "full_row": dict(policy="full_row"), "no-raster": dict(swizzle=0),
          "b-evict-first": dict(b_evict_first=True)}


# our kernels' names: gemm_kernel, gemm_swapped_kernel (swap configs), gemm_splitk_kernel (split-K), gemm_softmax_kernel
# torch's fill kernel, which zeroes the flush buffer (its name has "FillFunctor")
FLUSH_KERNEL = "FillFunctor"
STALL_REASONS = r"regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$"
KERNEL_REGEX = {"gemm": "regex:^gemm_(swapped_|splitk_)?kernel", "gemm_softmax": "regex:^gemm_softmax_kernel"}


def print_stalls(child, top, op, l2="clean", csv_path=None):
    """ncu's source view of our kernel (second launch): the ``top`` SASS instructions by warp-stall samples,
    under the same L2 state as the counters; ``csv_path``: the whole source view written there."""
    cmd = ["ncu", "--clock-control", "none", *l2_state_flags(l2), "-k", KERNEL_REGEX[op], "--launch-skip", "1",
           "--launch-count", "1",
           "--section", "SourceCounters", "--page", "source", "--print-source", "sass", "--csv"] + child
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rows = [r for r in csv.reader(io.StringIO(proc.stdout)) if len(r) > 3]
    head = next((i for i, r in enumerate(rows) if "Source" in r and any("Sampling" in c for c in r)), None)
    if proc.returncode or head is None:
        print(f"ncu source view unavailable ({proc.returncode}):\n{proc.stdout[:3000]}\n{proc.stderr[-1500:]}")
        return
    header = rows[head]
    col = next(i for i, c in enumerate(header) if "Sampling" in c and "Not" not in c)
    src = header.index("Source")
    value = lambda r: float((r[col] or "0").replace(",", "")) if len(r) > col else 0.0  # noqa: E731
    body = [r for r in rows[head + 1:] if len(r) == len(header)]
    total = sum(value(r) for r in body) or 1
    print(f"{header[col]} by SASS instruction ({total:.0f} in all), top {top}:")
    for r in sorted(body, key=value, reverse=True)[:top]:
        print(f"{100 * value(r) / total:5.1f}%  {r[src][:100]}")
    if csv_path:  # every column of the source view (per-instruction stall reasons where this ncu gives them)
        with open(csv_path, "w") as f:
            f.write(proc.stdout)
        print(f"the source view's columns ({', '.join(header)}) in {csv_path}")


def print_stall_reasons(child, l2="clean"):
    """Why the warps of each kernel in the profiled range (ours and cuBLAS's) did not issue: ncu's warp-state
    sampling, in warps per issued instruction by reason, largest first (a spin-wait shows as issued work)."""
    proc = subprocess.run(ncu_cmd([STALL_REASONS], child, l2), capture_output=True, text=True)
    lines = ncu_table(proc.stdout)
    if proc.returncode or not lines:
        print(f"ncu stall reasons unavailable ({proc.returncode}): {(proc.stdout + proc.stderr).strip()[-600:]}")
        return
    kernels = {}
    for r in kernel_rows(lines):
        reason = re.sub(r"^smsp__average_warps_issue_stalled_|_per_issue_active\.ratio$", "", r["Metric Name"])
        try:
            kernels.setdefault((r["ID"], r["Kernel Name"][:40]), {})[reason] = float(r["Metric Value"].replace(",", ""))
        except ValueError:
            pass
    for (_, name), reasons in kernels.items():
        top = sorted(((v, k) for k, v in reasons.items() if v >= 0.05), reverse=True)
        print(f"stalls per issued instruction, {name}: {sum(reasons.values()):.2f} in all; "
              + ", ".join(f"{k} {v:.2f}" for v, k in top))


def our_launch(op, shape, dtype, config):
    """``launch(a, b, c)`` of our kernel for ``op`` at ``shape``."""
    from tile_ops.kernels.gemm_config import GemmConfig
    from tile_ops.kernels.gemm_defaults import default_config
    from tile_ops.kernels.gemm_launch import build_gemm
    from tile_ops.kernels.gemm_softmax import gemm_softmax

    M, N, K = shape
    if op == "gemm_softmax":
        if config:
            sys.exit("--config names GEMM configs; --op gemm_softmax profiles the fused kernel's default")
        k = gemm_softmax(M, N, K, 0.125, dtype, dtype, target="sm_90a")
        return k.launch
    cfg = parse_config(config, GemmConfig) if config else default_config(M, N, K, "sm_90a")
    k = build_gemm(M, N, K, 1, 1, 1, False, False, False, dtype, dtype, cfg, target="sm_90a")
    return lambda a, b, c: k.launch_ptrs([a.data_ptr(), b.data_ptr(), c.data_ptr(), c.data_ptr()], a.device)


def profiled_calls(ours, theirs, torch, flush=lambda: None):
    """``ours()`` and ``theirs()`` once each, then once more each between ``torch.cuda.profiler.start()`` and
    ``stop()``: under ``ncu --profile-from-start off`` exactly the kernels of the second calls are profiled,
    however many each launches (a split-K or padded gemm of ours, cuBLAS's splitKreduce_kernel at decode).
    ``flush()`` runs before each call (its kernels are profiled too; main() leaves them out)."""
    ours()
    theirs()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    flush()
    ours()
    flush()
    theirs()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def l2_state_flags(l2):
    """ncu's flags for the L2 state: a dirty L2 must survive to each profiled kernel, so no cache control, and
    each pass replays the whole process (kernel replay would restore memory between passes)."""
    return ["--cache-control", "none", "--replay-mode", "application"] if l2 == "dirty" else []


def ncu_table(stdout: str) -> str:
    """The CSV table of an ncu run's output (after its log lines), or "" where it printed none."""
    return stdout[stdout.find('"ID"'):] if '"ID"' in stdout else ""


def kernel_rows(table: str):
    """The rows of ``ncu_table``'s CSV, but for the L2 flush's own kernels (--l2 dirty)."""
    return (r for r in csv.DictReader(io.StringIO(table)) if FLUSH_KERNEL not in r["Kernel Name"])


def ncu_cmd(metrics, child, l2="clean"):
    """ncu over ``child`` (which runs ``profiled_calls``): the listed metrics of the kernels in its profiled range.
    Names print demangled (ncu's default), so the flush's fill kernel shows its FillFunctor."""
    return ["ncu", "--clock-control", "none", "--profile-from-start", "off", *l2_state_flags(l2), "--csv",
            "--metrics", ",".join(metrics)] + child


def run_kernels(op, shape, dtype, config, l2):
    import torch

    M, N, K = shape
    launch = our_launch(op, shape, dtype, config)
    dt = getattr(torch, dtype)
    a, b = torch.randn(M, K, dtype=dt, device="cuda"), torch.randn(K, N, dtype=dt, device="cuda")
    c = torch.empty(M, N, dtype=dt, device="cuda")
    flush = lambda: None  # noqa: E731
    if l2 == "dirty":
        from common import l2_flusher  # the child runs as a script: this directory leads sys.path

        flush = l2_flusher()
    profiled_calls(lambda: launch(a, b, c), lambda: torch.matmul(a, b), torch, flush)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="4096x4096x4096")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--config", help="a bench_gemm.py config name; default: the library's default config")
    p.add_argument("--stalls", type=int, default=0, help="also print the N SASS lines with the most stall samples, "
                   "and each kernel's stall reasons")
    p.add_argument("--stalls-csv", help="with --stalls: write ncu's whole source view (CSV) to this file")
    p.add_argument("--op", choices=sorted(KERNEL_REGEX), default="gemm", help="which of our kernels")
    p.add_argument("--l2-sources", action="store_true",
                   help="also split the L2's traffic by source (the SMs, the fabric between its partitions) and give "
                        "the SMs' reads the L2 served beside the bytes that arrived in the SMs")
    p.add_argument("--l2", choices=("clean", "dirty"), default="clean",
                   help="the L2 before each kernel: flushed clean by ncu, or dirty as bench_gemm.py leaves it")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    shape = tuple(map(int, args.shape.split("x")))
    if args.child:
        return run_kernels(args.op, shape, args.dtype, args.config, args.l2)
    child = [sys.executable, os.path.abspath(__file__), "--child", "--shape", args.shape, "--dtype", args.dtype,
             "--op", args.op, "--l2", args.l2]
    child += ["--config", args.config] if args.config else []
    names = {**METRICS, **(L2_SOURCES if args.l2_sources else {})}
    base = [m for m in METRICS if not m.endswith("pct_of_peak_sustained_active")]
    extra = list(L2_SOURCES) if args.l2_sources else []
    older = extra[:2]  # the two sources an older ncu had before the read and into-the-SMs counters
    tries = [list(METRICS) + extra, list(METRICS) + older, list(METRICS), base + extra, base + older, base]
    for metrics in dict.fromkeys(map(tuple, tries)):
        # then without the counters an older ncu or driver may lack (the L2 sources; gmma, l1tex)
        # the second call of ours and of cuBLAS, every kernel of each (a fixed launch window, "skip 4, count 2",
        # caught cuBLAS's splitKreduce_kernel instead of its GEMM at decode, and half of a split-K gemm of ours)
        proc = subprocess.run(ncu_cmd(metrics, child, args.l2), capture_output=True, text=True)
        lines = ncu_table(proc.stdout)
        if proc.returncode == 0 and lines:
            break
        print(f"ncu refused counters ({proc.returncode}: {(proc.stdout + proc.stderr).strip()[-300:]}); "
              f"trying without some")
    else:
        sys.exit(f"ncu failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    if missing := [names[m] for m in names if m not in metrics]:
        print(f"(this ncu gave no {', '.join(missing)})")
    rows, full_names = {}, {}
    for r in kernel_rows(lines):
        name = r["Kernel Name"][:40]
        full_names.setdefault(name, r["Kernel Name"])
        col = names[r["Metric Name"]]
        try:
            value = round(float(r["Metric Value"].replace(",", "")) * SCALE.get(col, 1), 3)
        except ValueError:  # "n/a": the counter is not available for this kernel
            value = r["Metric Value"]
        rows.setdefault((r["ID"], name), {})[col] = value
    cols = [names[m] for m in metrics]
    print(f"ncu, {args.shape} {args.dtype}, L2 {args.l2}, every kernel of the second call of ours and of cuBLAS")
    print("kernel".ljust(42) + "  ".join(c.rjust(max(8, len(c))) for c in cols))
    for (_, name), vals in rows.items():
        print(name.ljust(42) + "  ".join(f"{vals.get(c, '')}".rjust(max(8, len(c))) for c in cols))
    for name, full in full_names.items():  # cuBLAS's name carries its tile, cluster and split-K/stream-K choice
        if full != name:
            print(f"{name}: {full}")
    if args.stalls:
        print_stalls(child, args.stalls, args.op, args.l2, args.stalls_csv)
        print_stall_reasons(child, args.l2)


if __name__ == "__main__":
    main()
