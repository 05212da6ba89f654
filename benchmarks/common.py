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


def paired_medians(fns, rounds):
    """{name: median ms} of ``fns`` ({name: fn}) timed in turn, ``rounds`` times over: clock and heat drift hit
    each alike, and a winner picked from a sweep's single timings (the luckiest of many) is timed again beside
    its anchor instead of being compared with the anchor's one timing on a GPU the sweep heated."""
    ms = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            ms[name].append(bench_ms(fn))
    return {name: statistics.median(v) for name, v in ms.items()}


def fastest_correct(kernels, check, run, tolerance, name, unit):
    """``(ms, relative error, config)`` of the fastest of ``kernels`` ({config: kernel}) that passes its check,
    or ``(inf, None, None)``.  ``check(kernel)`` launches once and returns the relative error against the
    float64 reference; a kernel at or over ``tolerance`` is reported WRONG and never timed (a wrong kernel
    never wins).  ``run(kernel)`` is what gets timed; each timing is printed as ``name(config): unit(ms)``."""
    best = (float("inf"), None, None)
    for cfg, kernel in kernels.items():
        err = check(kernel)
        if not err < tolerance:
            print(f"WRONG {name(cfg)}: relative error {err:.1e}", file=sys.stderr)
            continue
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
