"""``python -m tile_ops tune``: run the autotuner, list config spaces, show or clear the tuned table.

    tile_ops tune gemm --shape 4096x4096x4096 [--shape ...] [--dtype float16 bfloat16] [--compile-only]
    tile_ops tune --list [gemm] [--shape MxNxK] [--arch sm_90a]     the declared config spaces
    tile_ops tune --show                                             the tuned table
    tile_ops tune --clear                                            empty the tuned table
"""

from __future__ import annotations

import dataclasses
import sys

from ..cli_common import parse_arch, parse_jobs, parse_shape, print_table
from . import targets

DTYPES = ("float16", "bfloat16")


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="autotune kernel configs on this GPU (or --list / --show / --clear)",
                       description="Compile a kernel's declared config space in parallel, check and time each "
                       "candidate on the GPU, and record the fastest in <cache dir>/autotune.json, where the "
                       "ops find it.")
    p.add_argument("op", nargs="?", choices=sorted(targets.TARGETS), help="the op to tune (or list)")
    p.add_argument("--shape", nargs="+", type=parse_shape, metavar="MxNxK", help="problem shape(s) to tune")
    p.add_argument("--dtype", nargs="+", default=["float16"], choices=DTYPES)
    p.add_argument("--arch", type=parse_arch, help="target arch (default: the local GPU's, else sm_90a)")
    p.add_argument("--compile-only", action="store_true",
                   help="build the candidates into the kernel cache without timing them (no GPU needed)")
    p.add_argument("--no-save", action="store_true", help="report the results without recording the best")
    p.add_argument("--jobs", "-j", type=parse_jobs, default=None, help="compile threads (default: the CPU count)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--list", action="store_true", help="list the tunable ops and config fields; with an op "
                      "and --shape, its candidates and their shared-memory estimates")
    what.add_argument("--show", action="store_true", help="show the tuned table")
    what.add_argument("--clear", action="store_true", help="remove every tuned entry")
    p.set_defaults(func=cmd_tune, tune_parser=p)


def cmd_tune(args) -> int:
    whole = "--show" if args.show else "--clear" if args.clear else None
    if whole and (args.op or args.shape):  # ignored, `tune --clear gemm` cleared every op's entries
        args.tune_parser.error(f"{whole} covers the whole tuned table: it takes no op or --shape")
    if args.show:
        return show()
    if args.clear:
        return clear()
    if args.list:
        return list_spaces(args)
    if args.op is None or not args.shape:
        args.tune_parser.error("give an op and --shape MxNxK to tune (e.g. `tune gemm --shape 4096x4096x4096`), "
                               "or --list / --show / --clear")
    return run(args)


# --------------------------------------------------------------------------------------------- tune
def run(args) -> int:
    from ..jit.cache import not_stored
    from . import tune
    from .table import TableWriteError

    if not args.compile_only and not _gpu_available():
        print("tile_ops tune: no CUDA GPU: timing needs one. --compile-only builds the candidates into the "
              "kernel cache without timing them.", file=sys.stderr)
        return 2
    failed = False
    for shape in args.shape:
        for dtype in args.dtype:
            label = f"{args.op} {'x'.join(map(str, shape))} {dtype}"
            print(f"\n== {label}", flush=True)
            not_stored.clear()
            try:
                result = tune(args.op, shape, dtype, arch=args.arch, compile_only=args.compile_only,
                              save=not args.no_save, workers=args.jobs, show_progress=not args.quiet)
            except TableWriteError as e:  # tune() printed what it found
                print(f"error: {str(e).removeprefix('tile_ops: ')}", file=sys.stderr)
                return 1
            print_candidates(result)
            failed |= not _summarize(result, args.compile_only)
            if args.compile_only and not_stored:  # built, but the next run (or the op) compiles them again
                reason = next(iter(not_stored.values()))
                print(f"{len(not_stored)} kernel(s) built but NOT stored in the kernel cache ({reason})",
                      file=sys.stderr)
                failed = True
    return 1 if failed else 0


def print_candidates(result) -> None:
    target = targets.get(result.op)
    fields = [f.name for f in dataclasses.fields(result.default)]
    order = sorted(result.candidates, key=lambda c: (c.ms is None, c.ms or 0.0, c.skipped is not None))
    rows = []
    for c in order:
        row = dict(dataclasses.asdict(c.config))
        if c.compile_s is not None:
            row["compile_s"] = f"{c.compile_s:.1f}"
        if c.ms is not None:
            row["ms"] = f"{c.ms:.4f}"
            row["TFLOP/s"] = f"{target.flops(result.shape) / c.ms / 1e9:.1f}"
        row["note"] = ("default" if c.config == result.default else "") + (
            f" SKIPPED {c.skipped.splitlines()[0][:120]}" if c.skipped else "")
        rows.append(row)
    timing = ["ms", "TFLOP/s"] if any(c.ms is not None for c in result.candidates) else []
    print_table(rows, fields + ["compile_s"] + timing + ["note"])


def _summarize(result, compile_only: bool) -> bool:
    n = len(result.candidates)
    skipped = sum(c.skipped is not None for c in result.candidates)
    if compile_only:
        print(f"{n - skipped} of {n} candidates built for {result.arch}, {skipped} skipped")
        return n > skipped
    best = result.best
    if best is None:
        print(f"every one of the {n} candidates failed; nothing recorded", file=sys.stderr)
        return False
    vs = f" ({result.default_ms / best.ms:.2f}x the default's {result.default_ms:.4f} ms)" if result.default_ms else ""
    print(f"best of {n - skipped} timed ({skipped} skipped) on {result.gpu}: {best.ms:.4f} ms{vs}")
    print(f"  {best.config}")
    if result.key:
        from .table import table_path

        print(f"  recorded in {table_path()} as {result.key!r}")
    return True


def _gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


# --------------------------------------------------------------------------------- list/show/clear
def list_spaces(args) -> int:
    from ..jit import default_arch
    from .tuner import make_candidates, prune, smem_limit

    if args.shape and args.op is None:
        args.tune_parser.error("--list --shape needs an op (e.g. `tune --list gemm --shape 4096x4096x4096`)")
    ops = [args.op] if args.op else sorted(targets.TARGETS)
    for op in ops:
        target = targets.get(op)
        cls = target.config_class()
        fields = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls))
        print(f"{op}: {cls.__module__}.{cls.__name__}({fields})")
        arch = args.arch or default_arch()
        for shape, dtype in ((s, d) for s in args.shape or [] for d in args.dtype):
            cands = make_candidates(target, shape, dtype, arch)
            limit = smem_limit(arch)
            prune(target, cands, shape, dtype, limit)
            print(f"\n{len(cands)} candidates for {'x'.join(map(str, shape))} {dtype} on {arch} "
                  f"(shared memory limit {limit} B):")
            rows = [{**dataclasses.asdict(c.config),
                     "smem_est": target.shared_memory_bytes(c.config, shape, dtype),
                     "note": ("default " if c.config == target.default_config(shape, arch) else "") + (c.skipped or "")}
                    for c in cands]
            print_table(rows, [f.name for f in dataclasses.fields(cls)] + ["smem_est", "note"])
    return 0


def show() -> int:
    from .table import TuneTable

    table = TuneTable()
    entries = table.entries()  # the well-formed ones (a warning names the others): every field formats
    print(f"tuned table: {table.path} ({len(entries)} entr{'y' if len(entries) == 1 else 'ies'})")
    rows = []
    for key in sorted(entries):
        e = entries[key]
        default_ms, ms = e.get("default_ms"), e.get("ms")
        rows.append({"gpu": e["gpu"], "op": e["op"], "dtype": e["dtype"], "arch": e.get("arch") or "any",
                     "shape": "x".join(map(str, e["shape"])),
                     "config": " ".join(f"{k}={v}" for k, v in e["config"].items()),
                     "ms": f"{ms:.4f}" if ms else "",
                     "vs_default": f"{default_ms / ms:.2f}x" if ms and default_ms else "",
                     "tuned_at": e.get("tuned_at") or ""})
    if rows:
        print_table(rows, ["gpu", "op", "dtype", "arch", "shape", "config", "ms", "vs_default", "tuned_at"])
    return 0


def clear() -> int:
    from .table import TableWriteError, TuneTable

    table = TuneTable()
    try:
        n = table.clear()
    except TableWriteError as e:
        print(f"error: {str(e).removeprefix('tile_ops: ')}", file=sys.stderr)
        return 1
    print(f"removed {n} tuned entr{'y' if n == 1 else 'ies'} from {table.path}")
    return 0
