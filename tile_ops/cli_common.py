"""What the command line's commands (``python -m tile_ops demo | cache | precompile | tune``) share: argument types
and the table they print."""

from __future__ import annotations

import argparse
import math
import sys


def print_table(rows, columns, title=None, file=None):
    file = file or sys.stdout
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c) for c in columns]
    if title:
        print(title, file=file)
    print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(columns, widths))), file=file)
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) if i == 0 else str(r.get(c, "")).rjust(w)
                        for i, (c, w) in enumerate(zip(columns, widths))), file=file)
    file.flush()


def parse_shape(text: str) -> tuple:
    parts = text.lower().replace("*", "x").split("x")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) <= 0:
        raise argparse.ArgumentTypeError(f"expected a shape MxNxK of three positive integers, got {text!r}")
    return dims


def parse_arch(text: str) -> str:
    from .jit import check_arch

    try:
        return check_arch(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("tile_ops: ")) from None


def parse_scale(text: str) -> float:
    try:
        scale = float(text)
    except ValueError:
        scale = math.nan
    if not math.isfinite(scale):  # the op refuses such a scale: its kernel could never launch
        raise argparse.ArgumentTypeError(f"expected a finite float, got {text!r}")
    return scale


def parse_jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of threads, at least 1, got {text!r}")
    return n
