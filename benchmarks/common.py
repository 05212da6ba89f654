"""Shared helpers for the benchmark scripts: timing, tables, JSON and plots."""

import json
import sys

import torch


def bench_ms(fn, rep_ms=200):
    """Median milliseconds of fn() (CUDA events, after warm-up), via triton.testing.do_bench."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=rep_ms, return_mode="median")


def print_table(rows, columns, title):
    widths = [max(len(c), *(len(f"{r.get(c, '')}") for r in rows)) for c in columns]
    print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(f"{r.get(c, '')}".rjust(w) for c, w in zip(columns, widths)))
    sys.stdout.flush()


def save(rows, json_path=None, png_path=None, x="shape", ys=(), ylabel=""):
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    if png_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(max(6, len(rows)), 4))
        width = 0.8 / max(1, len(ys))
        for i, y in enumerate(ys):
            ax.bar([j + i * width for j in range(len(rows))], [float(r.get(y) or 0) for r in rows], width, label=y)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [r[x] for r in rows], rotation=30, ha="right")
        ax.set_ylabel(ylabel)
        ax.legend()
        fig.tight_layout()
        fig.savefig(png_path)
