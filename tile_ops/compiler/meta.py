"""What a launcher needs to know of a compiled kernel: the one metadata type that the compiler builds,
the JIT completes and the cache stores as JSON.  No TVM import, so a cached kernel loads without it."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

WORKSPACE = "tile_ops_workspace"  # the CUDA entry parameter of a kernel's global workspace (stream_k.py)
FLAG_SLOTS = 4096  # int32 flags at the workspace's start, one per CTA at most


def span(shape, strides):
    """The elements a strided view reaches, one past its last element's offset (ints, or expressions of sizes);
    a view with an empty dimension reaches none."""
    if any(isinstance(n, int) and n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def evaluate(value, dims: dict) -> int:
    """A meta value: an int, or the Python expression (a str) of the kernel's ``T.dynamic`` sizes the compiler
    wrote for it, evaluated with ``dims`` (name -> int, or a PlanExpr: then the value is one too)."""
    if isinstance(value, int):
        return value
    return eval(_code(value), {"__builtins__": {}, "min": _min, "max": _max}, dims)  # noqa: S307 - the compiler's


class PlanExpr:
    """An integer of a plan family as an expression of its runtime size m (csrc/plans.cpp's Expr): postfix
    (opcode, operand) pairs, built by arithmetic on ``PlanExpr.m()`` and ints (``evaluate`` with it among the
    sizes builds a meta value's).  Arithmetic on ints alone stays int."""

    OPCODES = {"const": 0, "m": 1, "+": 2, "-": 3, "*": 4, "//": 5, "%": 6, "min": 7, "max": 8}

    def __init__(self, code: tuple):
        self.code = tuple(code)

    @staticmethod
    def m() -> "PlanExpr":
        return PlanExpr((PlanExpr.OPCODES["m"], 0))

    @staticmethod
    def apply(op: str, a, b):
        """``a op b`` (+ - * // % min max) of ints and PlanExprs."""
        if not isinstance(a, PlanExpr) and not isinstance(b, PlanExpr):
            return _INT_OPS[op](a, b)
        code = lambda x: x.code if isinstance(x, PlanExpr) else (0, int(x))  # noqa: E731
        return PlanExpr(code(a) + code(b) + (PlanExpr.OPCODES[op], 0))

    def value(self, m: int) -> int:
        """The expression at m (what the extension computes)."""
        stack = []
        for op, operand in zip(self.code[::2], self.code[1::2]):
            if op < 2:
                stack.append(operand if op == 0 else m)
            else:
                b = stack.pop()
                stack.append(_INT_OPS[_OPNAMES[op]](stack.pop(), b))
        return stack[0]

    def __repr__(self) -> str:
        return f"PlanExpr{self.code}"

    __add__ = lambda self, o: PlanExpr.apply("+", self, o)  # noqa: E731
    __radd__ = lambda self, o: PlanExpr.apply("+", o, self)  # noqa: E731
    __sub__ = lambda self, o: PlanExpr.apply("-", self, o)  # noqa: E731
    __rsub__ = lambda self, o: PlanExpr.apply("-", o, self)  # noqa: E731
    __mul__ = lambda self, o: PlanExpr.apply("*", self, o)  # noqa: E731
    __rmul__ = lambda self, o: PlanExpr.apply("*", o, self)  # noqa: E731
    __floordiv__ = lambda self, o: PlanExpr.apply("//", self, o)  # noqa: E731
    __rfloordiv__ = lambda self, o: PlanExpr.apply("//", o, self)  # noqa: E731
    __mod__ = lambda self, o: PlanExpr.apply("%", self, o)  # noqa: E731
    __rmod__ = lambda self, o: PlanExpr.apply("%", o, self)  # noqa: E731


_INT_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "//": lambda a, b: a // b,
            "%": lambda a, b: a % b, "min": min, "max": max}
_OPNAMES = {v: k for k, v in PlanExpr.OPCODES.items()}


def _min(a, b):
    return PlanExpr.apply("min", a, b)


def _max(a, b):
    return PlanExpr.apply("max", a, b)


@functools.lru_cache(maxsize=None)
def _code(expression: str):
    return compile(expression, "<tile_ops dim expression>", "eval")


@dataclass
class KernelMeta:
    name: str
    arch: str
    # a persistent kernel's is the compile-time estimate, the launcher sizes it (Kernel.grid_on); grid, shapes,
    # persistent_tiles, workspace sizes and tensor-map dims and strides may be expressions of ``dims`` (evaluate)
    grid: tuple
    block: tuple
    smem_bytes: int
    params: list  # [(name, shape, dtype)] of the program, in order; a T.dynamic dimension by its name
    entry: str = ""  # the CUDA entry symbol (set once the source is emitted)
    kept: list = field(default_factory=list)  # parameter names the CUDA entry takes, in order (TVM drops unused ones)
    out_idx: list = field(default_factory=list)  # the params a call allocates and returns (the JIT's)
    resources: dict = field(default_factory=dict)  # ptxas's report: registers, spills (the JIT's)
    layouts: dict = field(default_factory=dict)  # buffer name -> the layout the compiler gave it, in words
    # kept name -> TMA descriptor spec {"tensor", "dtype", "dims", ...} (INTERFACES.md)
    tensormaps: dict = field(default_factory=dict)
    ctas_per_sm: int = 1  # CTAs meant to be resident per SM (__launch_bounds__'s minimum blocks)
    cluster: int = 1  # blocks per thread-block cluster
    cluster_dims: tuple = (1, 1, 1)  # __cluster_dims__
    persistent_tiles: int = 0  # > 0: the CTAs walk at most this many units; launch no more CTAs than that
    workspace_floats: int = 0  # > 0 (stream-K): fp32 partials per CTA in the workspace, after its flags
    workspace_fixed_floats: int = 0  # > 0: fp32 values the kernel keeps in the workspace, after its flags
    workspace_flags: int = 0  # int32 flags of the workspace the kernel's ops use (at most FLAG_SLOTS)
    # sm_90a: the kernel waits for the stream's previous kernel at its entry (griddepcontrol.wait), then lets
    # the next one launch: it can be launched programmatically (Kernel.dependent)
    waits_at_entry: bool = False
    dims: list = field(default_factory=list)  # [(name, multiple_of)]: the T.dynamic sizes, bound at launch
    strides: dict = field(default_factory=dict)  # param name -> its strides (elements), where not row-major
    scalars: list = field(default_factory=list)  # [(name, dtype)]: T.Scalar parameters, passed after the dims

    @property
    def needs_workspace(self) -> bool:
        return bool(self.workspace_floats or self.workspace_fixed_floats)

    def replace(self, **changes) -> "KernelMeta":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: dict) -> "KernelMeta":
        d = dict(d)
        for key in ("grid", "block", "cluster_dims"):
            if key in d:
                d[key] = tuple(d[key])
        d["params"] = [(n, tuple(s), t) for n, s, t in d["params"]]
        d["dims"] = [tuple(x) for x in d.get("dims", ())]
        d["scalars"] = [tuple(x) for x in d.get("scalars", ())]
        return KernelMeta(**d)
