"""The tile IR: what a traced ``@T.prim_func`` becomes.

A program is traced once, in Python: loops yield symbolic ``tvm.tirx.Var``s, index and
scalar arithmetic builds ``tvm.tirx`` expressions, and every tile operation appends a node
(with the user's source location) to the innermost open body.  The compiler turns this
tree into TIRx.
"""

from __future__ import annotations

import functools
import linecache
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import tvm
from tvm import tirx
from tvm.ir._overload_prim_expr import EqualOp, NotEqualOp
from tvm.ir.expr import ExprOperand, TensorLoad

from .errors import TileLangError

_LANG_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Loc:
    filename: str
    lineno: int

    @property
    def line(self) -> str:
        return linecache.getline(self.filename, self.lineno).strip()

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno}: {self.line}"


def _ours(frame) -> bool:
    """Whether ``frame`` runs tile_ops.lang: its files, or generated code (a dataclass's ``__init__``, filed as
    ``<string>``) in its modules' globals."""
    return (frame.f_globals.get("__name__", "").startswith("tile_ops.lang")
            or os.path.abspath(frame.f_code.co_filename).startswith(_LANG_DIR))


def user_loc() -> Loc | None:
    """The innermost stack frame outside tile_ops.lang: the line of the user's kernel."""
    frame = sys._getframe(1)
    while frame is not None:
        if not _ours(frame):
            return Loc(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None


def expr_dtype(x) -> str:
    """The dtype of a Python or numpy number or a TIRx expression ("" when it has none we know)."""
    if isinstance(x, int):  # (bool too)
        return "int32"
    if isinstance(x, float):
        return "float32"
    return str(getattr(x, "ty", None) or getattr(x, "dtype", ""))


def error(loc: Loc | None, reason: str, kind: type = TileLangError) -> TileLangError:
    where = f"{loc.filename}:{loc.lineno}" if loc else "<unknown location>"
    src = f"\n    {loc.line}" if loc and loc.line else ""
    err = kind(f"{where}: {reason}{src}")
    err.located = loc is not None
    return err


# ----------------------------------------------------------------------------- truth values

_TVM_DIR = os.path.dirname(os.path.abspath(tvm.__file__))


def _refuse_traced_truth(cls):
    """While this thread traces a kernel, bool() of an expression asked by the kernel's code (``if``,
    ``and``/``or``/``not``, min()/max()) is an error at its line: TVM raises a bare ValueError for most
    expressions, and answers == and != by object identity (``bx == 0`` is False), which would silently
    trace one branch for every block."""
    original = cls.__bool__

    def __bool__(self):
        frame = sys._getframe(1)
        if tracers() and not _ours(frame) and not os.path.abspath(frame.f_code.co_filename).startswith(_TVM_DIR):
            raise error(Loc(frame.f_code.co_filename, frame.f_lineno),
                        f"`{self}` is a value of the running kernel, which Python cannot branch on while tracing "
                        f"(if/while, and/or/not, min()/max() are decided once, at trace time, on compile-time "
                        f"constants); for values use T.if_then_else(cond, a, b) and T.min/T.max")
        return original(self)

    cls.__bool__ = __bool__


for _cls in (ExprOperand, EqualOp, NotEqualOp):
    _refuse_traced_truth(_cls)


# ----------------------------------------------------------------------------- buffers

SCOPES = ("global", "shared", "fragment", "local")


class TileBuffer:
    """A tensor parameter, shared-memory tile, register fragment or per-thread array.

    ``buf[i, j]`` is a scalar load (a tirx expression), ``buf[i, j] = v`` a store,
    ``buf[i0:i1, j0:j1]`` or ``buf[i0, j0]`` inside ``T.copy`` a region.
    """

    def __init__(self, name: str, shape, dtype: str, scope: str, loc: Loc | None, strides=None):
        assert scope in SCOPES
        self.name, self.dtype, self.scope, self.loc = name, str(dtype), scope, loc
        # a tensor parameter's dimension may be a T.dynamic size (a tirx Var); tiles are static
        self.shape = tuple(s if scope == "global" and not isinstance(s, int) else int(s) for s in shape)
        self.strides = strides  # a tensor parameter's, in elements (T.Tensor's strides); None: row-major
        # The logical buffer that loads refer to; the compiler maps it to physical storage.
        self.tir = tirx.decl_buffer(self.shape, self.dtype, name=name)

    def __repr__(self) -> str:
        return f"TileBuffer({self.name}, {self.shape}, {self.dtype}, {self.scope})"

    def _indices(self, idx) -> list:
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) != len(self.shape):
            raise error(user_loc(), f"{self.name} has {len(self.shape)} dims, indexed with {len(idx)}")
        for i in idx:
            for part in (i.start, i.stop) if isinstance(i, slice) else (i,):
                dtype = expr_dtype(part)
                if dtype.startswith(("float", "bfloat")):
                    raise error(user_loc(), f"{self.name} indexed with a {dtype} value ({part}); indices are "
                                            f"integers (T.cast(x, 'int32') where one is computed in floating point)")
        return list(idx)

    def __getitem__(self, idx):
        idx = self._indices(idx)
        if any(isinstance(i, slice) for i in idx):
            return Region.from_slices(self, idx)
        return tirx.BufferLoad(self.tir, [tirx.const(i, "int32") if isinstance(i, int) else i for i in idx])

    def __setitem__(self, idx, value):
        idx = self._indices(idx)
        masks = tracer().masks
        emit(Store(self, idx, value, functools.reduce(tirx.And, masks) if masks else None))


@dataclass
class Region:
    """A rectangular window of a buffer: ``starts`` (exprs) and static ``extents``."""

    buffer: TileBuffer
    starts: list
    extents: list  # ints, or None where the extent is taken from the other side of a copy

    @staticmethod
    def from_slices(buf: TileBuffer, idx) -> "Region":
        starts, extents = [], []
        for i, (s, dim) in enumerate(zip(idx, buf.shape)):
            if isinstance(s, slice):
                lo = 0 if s.start is None else s.start
                hi = dim if s.stop is None else s.stop
                ext = hi - lo
                try:
                    ext = int(tirx_simplify(ext))
                except (TypeError, ValueError):
                    raise error(user_loc(), f"slice {i} of {buf.name} must have a static extent")
                starts.append(lo)
                extents.append(ext)
            else:
                starts.append(s)
                extents.append(1)
        return Region(buf, starts, extents)

    @staticmethod
    def of(x) -> "Region":
        """Whole buffer, a region, or ``buf[i, j]`` (a start point; extents come from the peer)."""
        if isinstance(x, Region):
            return x
        if isinstance(x, TileBuffer):
            return Region(x, [0] * len(x.shape), list(x.shape))
        if isinstance(x, TensorLoad):
            buf = tracer().buffers.get(x.source)
            if buf is not None:
                return Region(buf, list(x.indices), [None] * len(x.indices))
        raise error(user_loc(), f"expected a buffer or a buffer region, got {type(x).__name__}")


def tirx_simplify(e):
    if isinstance(e, int):
        return e
    from tvm.sym.analyzer import Analyzer

    return Analyzer().simplify(e)


# ----------------------------------------------------------------------------- nodes


@dataclass
class Node:
    loc: Loc | None = field(default=None, init=False)


@dataclass
class Store(Node):
    buffer: TileBuffer
    indices: list
    value: Any
    mask: Any = None  # a boolean expression: the element is written only where it holds (``T.when``)


@dataclass
class Copy(Node):
    src: Region
    dst: Region
    eviction: str | None = None  # L2 priority of the lines a global read brings in ("evict_first", "evict_last")


@dataclass
class AtomicAdd(Node):
    """``T.atomic_add(dst, src)``: dst += src element by element, each addition atomic (other blocks add into
    the same global elements)."""
    src: Region
    dst: Region


@dataclass
class Gemm(Node):
    A: TileBuffer
    B: TileBuffer
    C: TileBuffer
    transpose_A: bool
    transpose_B: bool
    clear_accum: bool
    policy: str


@dataclass
class Fill(Node):
    buffer: TileBuffer
    value: Any


@dataclass
class Reduce(Node):
    kind: str  # "max" | "min" | "sum"
    src: TileBuffer
    dst: TileBuffer
    dim: int
    clear: bool


@dataclass
class ClusterReduce(Node):
    """Every block of a thread-block cluster ends with ``buffers`` reduced elementwise over the cluster, in
    one exchange: element by element, ``results[i]`` (an expression of ``peers[j][v]``, block j's value of
    buffer v) is buffer i's new value."""
    buffers: tuple  # of TileBuffer, one shape
    peers: list  # [block][buffer] -> tirx.Var
    results: tuple  # per buffer, an expression of the peers' vars


@dataclass
class RowReduceStore(Node):
    """``T.row_reduce_store``: ``tile`` stored with each row scaled by ``factor``, an expression of the row's
    statistics in this block (``own[v]``, stat v) and in every block of the grid row (``peers[j][v]``: the
    grid's x block j, same y).  ``body`` holds the tile ops the compiler orders around the exchange of
    statistics: staging ``tile`` into ``staged``, rescaling ``staged`` by the per-row ``factors[slot, row]``
    (two slots, alternating by tile) and storing it to the destination."""
    tile: TileBuffer
    stats: tuple  # row fragments
    own: list  # [stat] -> tirx.Var
    peers: list  # [block][stat] -> tirx.Var
    factor: Any
    staged: TileBuffer
    factors: TileBuffer
    slot: tirx.Var
    body: list = field(default_factory=list)

    @property
    def stage(self) -> "Copy":
        return self.body[0]

    @property
    def rescale(self) -> "Parallel":
        return self.body[1]

    @property
    def store(self) -> "Copy":
        return self.body[2]


@dataclass
class For(Node):
    var: tirx.Var
    extent: Any
    kind: str  # "serial" | "unroll" | "pipelined"
    num_stages: int = 1
    body: list = field(default_factory=list)
    mma_turns: bool = False  # pipelined: consumer warpgroups issue each step's gemms in turns (schedules/turns)


@dataclass
class Deferred(Node):
    """``T.deferred()``: the end of a pipelined loop's iteration, which the compiler may run during the next
    iteration at the block's place (the last iteration's after the loop)."""
    body: list = field(default_factory=list)


@dataclass
class Parallel(Node):
    vars: list
    extents: list
    body: list = field(default_factory=list)


@dataclass
class Kernel(Node):
    grid: list
    threads: int
    block_vars: list
    body: list = field(default_factory=list)
    allocs: list = field(default_factory=list)
    swizzle_panel: int = 0
    cluster: tuple = (1, 1)  # (x, y) extents of the rectangle of blocks forming a thread-block cluster (sm_90a)
    persistent: bool = True  # may the compiler make CTAs walk the tiles (sm_90a, more than one wave)
    pingpong: bool = False  # two consumer warpgroups per CTA, each running the program on alternate tiles
    stream_k: int = 0  # >= 2: the last wave's tiles split along K into up to this many parts (sm_90a)
    bindings: list = field(default_factory=list)  # (int32 Var, value): T.bind's, computed once a tile, in order


@dataclass
class Program:
    name: str
    params: list
    kernel: Kernel | None = None
    loc: Loc | None = None
    buffers: dict = field(default_factory=dict)  # logical tirx buffer var -> TileBuffer (what loads name)
    dims: list = field(default_factory=list)  # T.dynamic sizes (tirx Vars), bound at launch from the shapes
    scalars: list = field(default_factory=list)  # T.Scalar parameters (tirx Vars), passed by value at launch


# ----------------------------------------------------------------------------- tracing


class _Tracer:
    def __init__(self):
        self.bodies: list[list] = []
        self.kernel: Kernel | None = None
        self.names: dict[str, int] = {}
        self.buffers: dict = {}
        self.dims: list = []  # the program's T.dynamic sizes
        self.masks: list = []  # the conditions of the enclosing ``T.when`` blocks


_STATE = threading.local()  # programs may be traced concurrently (parallel compiles)


def tracers() -> list:
    if not hasattr(_STATE, "tracers"):
        _STATE.tracers = []
    return _STATE.tracers


def tracer() -> _Tracer:
    if not tracers():
        raise error(user_loc(), "tile operations are only valid inside a @T.prim_func body")
    return tracers()[-1]


def emit(node: Node) -> Node:
    t = tracer()
    if not t.bodies:
        raise error(user_loc(), f"{type(node).__name__.lower()} outside `with T.Kernel(...)`")
    if t.masks and not isinstance(node, Store):
        raise error(user_loc(), f"a T.when block holds element assignments (buf[i] = value) only, not a tile op or "
                                f"loop ({type(node).__name__}); put the T.when inside the T.Parallel, around the "
                                f"assignments")
    node.loc = user_loc()
    t.bodies[-1].append(node)
    return node


def fresh_name(base: str) -> str:
    t = tracer()
    n = t.names.get(base, 0)
    t.names[base] = n + 1
    return base if n == 0 else f"{base}_{n}"


def new_buffer(shape, dtype, scope, name=None) -> TileBuffer:
    t = tracer()
    loc = user_loc()
    if t.kernel is None:
        raise error(loc, f"T.alloc_{scope} outside `with T.Kernel(...)`")
    if isinstance(shape, int):
        shape = (shape,)
    try:
        shape = tuple(int(tirx_simplify(s)) for s in shape)
    except (TypeError, ValueError):
        raise error(loc, f"the shape of a {scope} buffer must be static, got {shape}")
    m = re.match(r"\s*([A-Za-z_]\w*)\s*=", loc.line) if loc else None  # `A_s = T.alloc_shared(...)`
    base = name or (m.group(1) if m else {"shared": "smem", "fragment": "frag", "local": "loc"}[scope])
    buf = TileBuffer(fresh_name(base), shape, dtype, scope, loc)
    t.buffers[buf.tir] = buf
    t.kernel.allocs.append(buf)
    return buf


def walk(body):
    """Every node of ``body``, and of the bodies of loops and other nodes with one, in program order."""
    for node in body:
        yield node
        yield from walk(getattr(node, "body", ()))
