"""Shared helpers for the benchmark scripts: timing, tables, JSON and plots."""

import json
import statistics
import sys

import torch


# issue 4's four large GEMM shapes (M, N, K), whose geomean ratio to cuBLAS is the headline bar
LARGE_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 1024, 8192), (4096, 14336, 4096)]


def bench_ms(fn, rep_ms=200):
    """Median milliseconds of fn() (CUDA events, after warm-up), via triton.testing.do_bench."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=rep_ms, return_mode="median")


def paired_medians(fns, rep_ms=1200, warmup_ms=50, flush=None):
    """{name: median ms} of ``fns`` ({name: fn}) timed call by call in turn, each call after the same L2
    flush (``flush()``; default: ``l2_flusher()``'s) and between CUDA events, for about ``rep_ms`` in all:
    clock, heat and power drift hit each alike.  (Blocks of 200 ms, one function's at a time, each drew a
    mode of its own: at 1000^3 on the H200 a kernel's median moved by 0.65 us from block to block.)"""
    flush = flush or l2_flusher()
    one_round = _round_ms(fns, flush)
    _rounds(fns, flush, max(1, int(warmup_ms / one_round)))
    calls = [(name, *timed_call(fn, flush)) for _ in range(max(5, int(rep_ms / one_round)))
             for name, fn in fns.items()]
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for n, s, e in calls if n == name) for name in fns}


def l2_flusher():
    """A function that evicts the L2 (Triton's benchmark buffer, zeroed), as do_bench does before each call."""
    from triton import runtime

    driver = runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()
    return lambda: driver.clear_cache(cache)


def timed_call(fn, flush):
    """(start, end) CUDA events around one call of ``fn`` after ``flush()``; read them after a synchronize."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    flush()
    start.record()
    fn()
    end.record()
    return start, end


def _round_ms(fns, flush, rounds=3):
    """Milliseconds of one flushed call of each of ``fns``, from ``rounds`` rounds after a first call each."""
    for fn in fns.values():
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _rounds(fns, flush, rounds)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / rounds


def _rounds(fns, flush, rounds):
    """``rounds`` untimed rounds of one flushed call of each of ``fns``."""
    for _ in range(rounds):
        for fn in fns.values():
            flush()
            fn()


def passing(kernels, check, tolerance, name):
    """{config: (kernel, relative error)} of ``kernels`` ({config: kernel}) whose check passes.  ``check(kernel)``
    launches once and returns the relative error against the float64 reference; a kernel at or over
    ``tolerance`` is reported WRONG, one whose launch raises FAILED (e.g. a cluster shape the device cannot
    schedule), and both are left out: a wrong kernel is never timed, and the others still run."""
    ok = {}
    for cfg, kernel in kernels.items():
        try:
            err = check(kernel)
        except Exception as e:  # noqa: BLE001
            print(f"FAILED {name(cfg)}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        if not err < tolerance:
            print(f"WRONG {name(cfg)}: relative error {err:.1e}", file=sys.stderr)
            continue
        ok[cfg] = (kernel, err)
    return ok


def fastest_correct(kernels, check, run, tolerance, name, unit):
    """``(ms, relative error, config)`` of the fastest of ``kernels`` ({config: kernel}) that passes its check
    (``passing``), or ``(inf, None, None)``.  ``run(kernel)`` is what gets timed; each timing is printed as
    ``name(config): unit(ms)``."""
    best = (float("inf"), None, None)
    for cfg, (kernel, err) in passing(kernels, check, tolerance, name).items():
        ms = bench_ms(lambda: run(kernel))
        print(f"{name(cfg)}: {unit(ms)}", file=sys.stderr)
        if ms < best[0]:
            best = (ms, err, cfg)
    return best


def pick_shapes(shapes, spec):
    """The (M, N, K) of ``shapes`` named in ``spec`` ("MxNxK,MxNxK"; None: all)."""
    return [s for s in shapes if not spec or "x".join(map(str, s)) in spec.split(",")]


def print_table(rows, columns, title):
    widths = [max(len(c), *(len(f"{r.get(c, '')}") for r in rows)) for c in columns]
    print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(f"{r.get(c, '')}".rjust(w) for c, w in zip(columns, widths)))
    sys.stdout.flush()


def png_path_or_none(path):
    """``path`` when a PNG plot can be written (matplotlib is importable); else None, saying so up front."""
    if path is None:
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"--png {path}: matplotlib is not installed, so no plot will be written (the table and --json "
              f"are not affected; `pip install matplotlib` for plots)", file=sys.stderr)
        return None
    return path


def save(rows, json_path=None, png_path=None, x="shape", ys=(), ylabel=""):
    """Write ``rows`` as JSON and/or a bar plot (``png_path`` from ``png_path_or_none``) of the ``ys``
    columns, one group per row labelled by column ``x`` (or a tuple of columns)."""
    if json_path:
        with open(json_path, "w") as f:
            device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
            json.dump({"device": device, "rows": rows}, f, indent=1)
    if png_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        keys = x if isinstance(x, tuple) else (x,)
        fig, ax = plt.subplots(figsize=(max(6, len(rows)), 4))
        ys = [y for y in ys if any(y in r for r in rows)]  # columns this run has
        width = 0.8 / max(1, len(ys))
        for i, y in enumerate(ys):
            ax.bar([j + i * width for j in range(len(rows))], [_number(r.get(y)) for r in rows], width, label=y)
        labels = [" ".join(str(r[k]) for k in keys) for r in rows]
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], labels, rotation=30, ha="right")
        ax.set_ylabel(ylabel)
        ax.legend()
        fig.tight_layout()
        fig.savefig(png_path)


def _number(v) -> float:
    """A table cell as a bar height: "-" (not measured) and missing cells are 0."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0
