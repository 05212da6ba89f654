"""User-facing functions of the tile language; each records a node of the tile IR."""

from __future__ import annotations

import builtins
import functools
import inspect
import math
import operator
from dataclasses import dataclass

from tvm import tirx

from . import MAX_CLUSTER, MAX_ROW_TILES, ir
from .ir import (AtomicAdd, ClusterReduce, Copy, Deferred, Fill, For, Gemm, Parallel as ParallelNode, Reduce, Region, TileBuffer, emit, error,
                 user_loc)

_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int32", "uint8")


def _check_dtype(dtype) -> str:
    dtype = str(dtype)
    if dtype not in _DTYPES:
        raise error(user_loc(), f"unsupported dtype {dtype!r}; accepted: {', '.join(_DTYPES)}")
    return dtype


def dynamic(name: str, multiple_of: int = 1):
    """A tensor dimension bound when the kernel launches: ``M = T.dynamic("M")``, then ``T.Tensor((M, K), ...)``.
    One compiled kernel serves every value: the launch reads it from the tensors' shapes, and grid extents
    (``T.ceildiv(M, 128)``), loop bounds, boundary predicates, TMA descriptors and persistent tile counts
    follow it.  ``multiple_of``: a divisor every value has (the launch checks it), which lets the compiler
    vectorize along that dimension or hand its rows to TMA (16-byte rows); 1 assumes nothing."""
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("tile_ops"):
        raise error(user_loc(), f"T.dynamic: name={name!r}; accepted: a Python identifier, e.g. 'M'")
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise error(user_loc(), f"T.dynamic({name!r}): multiple_of={multiple_of!r}; accepted: an int >= 1")
    var = tirx.Var(name, "int32")
    var.multiple_of = multiple_of  # read where the program is traced (ir.Program.dims)
    return var


def _dimension(d):
    """A tensor dimension: an int >= 0 (numpy's too), or a ``T.dynamic`` size."""
    if getattr(d, "multiple_of", None) is not None:
        return d
    try:
        n = operator.index(d)
    except TypeError:
        n = -1
    if n < 0:
        raise error(user_loc(), f"T.Tensor: dimension {d!r}; accepted: an int >= 0 or a T.dynamic size (an "
                                f"expression of one is not a dimension: declare a T.dynamic for it)")
    return n


@dataclass(frozen=True)
class Tensor:
    """Annotation of a global-memory tensor parameter: ``A: T.Tensor((M, K), "float16")``; a dimension is an
    int or a ``T.dynamic`` size.  ``strides`` (in elements; default row-major): a view's, e.g. a (B, H, S, D)
    view of a (B, S, H, D) tensor is ``strides=(sB, sH, sS, 1)``; each an int or a ``T.dynamic`` size, which
    the launch reads from the tensor's ``stride()``; the last is 1 (rows are contiguous)."""

    shape: tuple
    dtype: str = "float32"
    strides: tuple | None = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(_dimension(s) for s in self.shape))
        object.__setattr__(self, "dtype", _check_dtype(self.dtype))
        if self.strides is not None:
            strides = tuple(_dimension(s) for s in self.strides)
            if len(strides) != len(self.shape) or strides[-1] != 1:
                raise error(user_loc(), f"T.Tensor: strides={self.strides!r} for shape {self.shape!r}; accepted: one "
                                        f"stride per dimension, the last 1 (contiguous rows)")
            object.__setattr__(self, "strides", strides)


@dataclass(frozen=True)
class Scalar:
    """Annotation of a scalar parameter passed by value at each launch: ``scale: T.Scalar("float32")``
    (float32 or int32).  A value that changes from call to call without a new kernel (a softmax scale, a
    window size); a compile-time constant is a factory argument instead."""

    dtype: str = "float32"

    def __post_init__(self):
        if self.dtype not in ("float32", "int32"):
            raise error(user_loc(), f"T.Scalar: dtype={self.dtype!r}; accepted: 'float32' or 'int32'")


def prim_func(fn) -> ir.Program:
    """Trace ``fn`` (whose parameters are annotated with ``T.Tensor``) into a tile program."""
    loc = ir.Loc(fn.__code__.co_filename, fn.__code__.co_firstlineno)
    params, scalars, args = [], [], []
    tracer = ir._Tracer()
    for name, p in inspect.signature(fn).parameters.items():
        ann = p.annotation
        if isinstance(ann, str):
            raise error(loc, f"parameter {name!r} has a string annotation; remove `from __future__ import "
                             f"annotations` from the kernel's module (T.Tensor annotations must be evaluated)")
        if isinstance(ann, Scalar):
            scalars.append(tirx.Var(name, ann.dtype))
            args.append(scalars[-1])
            continue
        if not isinstance(ann, Tensor):
            raise error(loc, f"parameter {name!r} must be annotated with T.Tensor(shape, dtype) or T.Scalar(dtype)")
        buf = TileBuffer(name, ann.shape, ann.dtype, "global", loc, strides=ann.strides)
        tracer.buffers[buf.tir] = buf
        params.append(buf)
        args.append(buf)
    prog = ir.Program(fn.__name__, params, loc=loc, buffers=tracer.buffers, dims=_dims(loc, params), scalars=scalars)
    tracer.dims = prog.dims
    ir.tracers().append(tracer)
    try:
        fn(*args)
    finally:
        ir.tracers().pop()
    if tracer.kernel is None:
        raise error(loc, "a @T.prim_func body must contain one `with T.Kernel(...)` block")
    prog.kernel = tracer.kernel
    return prog


def _dims(loc, params) -> list:
    """The program's ``T.dynamic`` sizes, in the order the parameters' shapes (then strides) name them; one var
    per name."""
    dims = {}
    for p in params:
        for d in p.shape + (p.strides or ()):
            if isinstance(d, int):
                continue
            if dims.setdefault(d.name, d) is not d:
                raise error(loc, f"two T.dynamic sizes are named {d.name!r}; accepted: one T.dynamic per name, "
                                 f"used in every shape it sizes")
    return list(dims.values())


class Kernel:
    """``with T.Kernel(gx, gy=1, gz=1, threads=128, cluster=1, persistent=True, pingpong=False, stream_k=0)
    as (bx, by):``
    — the launch grid and block.

    ``cluster=n`` (sm_90a): each n neighbouring blocks along x form a thread-block cluster, scheduled
    together, whose blocks combine fragments with ``T.cluster_allreduce``; bx % n is a block's rank.
    ``cluster=(cx, cy)``: a cx-by-cy rectangle of blocks (grid x and y); its rank is bx % cx + by % cy * cx.
    In a cluster, a ``T.copy`` into a pipeline stage whose global window does not depend on bx (or by) is
    loaded once per cluster row (column) and multicast to its blocks.
    ``persistent=False`` (sm_90a) keeps one block per tile where the compiler would otherwise launch one
    CTA per SM walking the tiles (it does when a warp-specialized kernel has more than one wave).
    ``pingpong=True`` (threads=128): on the warp-specialized sm_90a path each CTA runs two copies of the
    program on alternate tiles, so one warpgroup's epilogue overlaps the other's main loop (CUTLASS's
    ping-pong); a schedule only: other paths run the program as written.
    ``stream_k=p`` (sm_90a, warp-specialized): the tiles of the last, partial wave of CTAs (clusters) are
    split along the main loop's K steps into up to ``p`` parts that run on otherwise idle CTAs; the parts'
    fp32 accumulators meet in a global workspace the launcher keeps, and the last part runs the rest of
    the tile (the epilogue).  Needs the one ``T.Pipelined`` loop at the body's top level with a trip count
    that is the same for every tile, and its gemm accumulators cleared right before it.  A schedule
    only: other paths run the program as written."""

    def __init__(self, *grid, threads: int = 128, cluster: int | tuple = 1, persistent: bool = True,
                 pingpong: bool = False, stream_k: int = 0):
        if not 1 <= len(grid) <= 3:
            raise error(user_loc(), "T.Kernel takes 1 to 3 grid extents")
        if threads % 32 or not 32 <= threads <= 1024:
            raise error(user_loc(), f"threads={threads}: must be a multiple of 32 in [32, 1024]")
        self.grid = [_grid_extent(g) for g in grid]
        if any(isinstance(g, int) and g < 1 for g in self.grid):
            raise error(user_loc(), f"T.Kernel: grid {self.grid}: every extent must be at least 1 (a problem with "
                                    f"nothing to compute has no kernel to launch)")
        self.threads = threads
        self.cluster = _cluster_dims(cluster, self.grid)
        if pingpong and (threads != 128 or not persistent):
            raise error(user_loc(), f"pingpong=True runs two 128-thread warpgroups over a persistent tile loop: "
                                    f"it needs threads=128 (got {threads}) and persistent=True (got {persistent})")
        if stream_k and (stream_k < 2 or pingpong or not persistent):
            raise error(user_loc(), f"stream_k={stream_k}: the most K parts of a tile, >= 2 (0: off); it needs "
                                    f"persistent=True and pingpong=False (got {persistent}, {pingpong})")
        self.persistent, self.pingpong = bool(persistent), bool(pingpong)
        self.stream_k = int(stream_k)

    def __enter__(self):
        t = ir.tracer()
        if t.kernel is not None:
            raise error(user_loc(), "only one T.Kernel block per program")
        names = ["bx", "by", "bz"][: len(self.grid)]
        k = ir.Kernel(self.grid, self.threads, [tirx.Var(n, "int32") for n in names], cluster=self.cluster,
                       persistent=self.persistent, pingpong=self.pingpong, stream_k=self.stream_k)
        k.loc = user_loc()
        t.kernel = k
        t.bodies.append(k.body)
        return k.block_vars[0] if len(k.block_vars) == 1 else tuple(k.block_vars)

    def __exit__(self, *exc):
        ir.tracer().bodies.pop()
        return False


# ----------------------------------------------------------------------------- memory


def alloc_shared(shape, dtype, name=None) -> TileBuffer:
    if len(shape) not in (1, 2):  # the compiler lays out (swizzles, stages, addresses) rows x columns
        raise error(user_loc(), f"T.alloc_shared({tuple(shape)}): shared tiles are 1-D or 2-D; fold the leading "
                                f"dims into the rows, e.g. ({math.prod(shape[:-1]) if shape else 1}, "
                                f"{shape[-1] if shape else 1})")
    return ir.new_buffer(shape, _check_dtype(dtype), "shared", name)


def alloc_fragment(shape, dtype, name=None) -> TileBuffer:
    return ir.new_buffer(shape, _check_dtype(dtype), "fragment", name)


def alloc_local(shape, dtype, name=None) -> TileBuffer:
    return ir.new_buffer(shape, _check_dtype(dtype), "local", name)


# ----------------------------------------------------------------------------- loops


def _loop(kind: str, extent, num_stages: int = 1, name: str = "k", mma_turns: bool = False):
    var = tirx.Var(ir.fresh_name(name), "int32")
    node = For(var, extent, kind, num_stages, mma_turns=mma_turns)
    emit(node)
    bodies = ir.tracer().bodies  # (an error that ends the trace closes this generator after the tracer is gone)
    bodies.append(node.body)
    try:
        yield var
    finally:
        bodies.pop()


def Pipelined(extent, num_stages: int = 2, mma_turns: bool = False):
    """A software-pipelined loop: global->shared copies in its body run ``num_stages - 1`` iterations ahead.
    ``mma_turns=True``: where a block has several consumer warpgroups (sm_90a, threads >= 256), they issue the
    gemms each iteration starts with in turns, warpgroup 0 first, so one's math runs under another's
    tensor-core work (FlashAttention-3's ping-pong); elsewhere it changes nothing."""
    if num_stages < 1:
        raise error(user_loc(), f"num_stages={num_stages}: must be >= 1")
    return _loop("pipelined", extent, num_stages, mma_turns=mma_turns)


class deferred:
    """``with T.deferred():`` inside a ``T.Pipelined`` loop: statements that end each iteration — the loop computes
    what it computes with the block moved to the end of its body — which the compiler may run one iteration
    late, at the block's place: iteration t's block during iteration t + 1, after the statements before it
    (and the last iteration's after the loop).  On sm_90a the block's tensor-core work then runs while what
    follows it computes: FlashAttention's P V of tile t - 1 under tile t's softmax.  The block must not touch
    what the statements before it write, nor write what they read (the compiler checks); the tiles the loop
    loads are those of the block's own iteration."""

    def __enter__(self):
        t = ir.tracer()
        owner = t.bodies[-2][-1] if len(t.bodies) >= 2 and t.bodies[-2] else None
        if not (isinstance(owner, For) and owner.kind == "pipelined" and owner.body is t.bodies[-1]):
            raise error(user_loc(), "T.deferred() belongs directly in the body of a T.Pipelined loop (it defers "
                                    "work to the loop's next iteration)")
        if any(isinstance(n, Deferred) for n in owner.body):
            raise error(user_loc(), "a T.Pipelined loop has one T.deferred() block; put every deferred statement "
                                    "in it")
        t.bodies.append(emit(Deferred()).body)

    def __exit__(self, *exc):
        ir.tracer().bodies.pop()


def serial(extent):
    return _loop("serial", extent, name="i")


def unroll(extent):
    return _loop("unroll", _static_extent(extent, "T.unroll"), name="i")


def Parallel(*extents):
    """Elementwise loop nest over a tile; the compiler maps iterations to threads (and vectorizes)."""
    extents = [_static_extent(e, "T.Parallel") for e in extents]
    vars_ = [tirx.Var(ir.fresh_name(n), "int32") for n in "ijkl"[: len(extents)]]
    node = ParallelNode(vars_, extents)
    emit(node)
    bodies = ir.tracer().bodies
    bodies.append(node.body)
    try:
        yield vars_[0] if len(vars_) == 1 else tuple(vars_)
    finally:
        bodies.pop()


def bind(value, name: str = "v"):
    """``seq = T.bind(Tiles[bx, 0])``: an integer value computed once for the block's tile, at the kernel's start,
    and used by name wherever it appears (a value read from global memory or a long expression would otherwise
    be recomputed, and its loads issued again, at every use).  It may use the block indices, the T.dynamic
    sizes, the T.Scalars, earlier T.bind values and loads from global tensors; it belongs at the top of the
    ``T.Kernel`` body, outside any loop."""
    t = ir.tracer()
    if t.kernel is None or len(t.bodies) != 1:
        raise error(user_loc(), "T.bind belongs at the top of the T.Kernel body (outside loops and T.Parallel): "
                                "its value is computed once a tile")
    value = value.asobject() if hasattr(value, "asobject") else value
    value = tirx.const(value, "int32") if isinstance(value, int) and not isinstance(value, bool) else value
    dtype = ir.expr_dtype(value)
    if not dtype.startswith("int"):
        raise error(user_loc(), f"T.bind: {value} is {dtype or type(value).__name__}; accepted: an integer value "
                                f"(int32)")
    if not isinstance(name, str) or not name.isidentifier():
        raise error(user_loc(), f"T.bind: name={name!r}; accepted: a Python identifier")
    var = tirx.Var(ir.fresh_name(name), "int32")
    t.kernel.bindings.append((var, tirx.Cast("int32", value) if dtype != "int32" else value))
    return var


class when:
    """``with T.when(cond):`` — the element assignments inside write only where ``cond`` holds, e.g. the rows of
    a tile that belong to a sequence (``with T.when(row < seq_len): O[start + row, j] = acc[i, j]``); elsewhere
    the element keeps what it held.  Inside ``T.Parallel`` ``cond`` may use the loop variables; nested blocks
    combine with and.  A store past a global tensor's end is skipped whether or not a mask says so."""

    def __init__(self, cond):
        cond = cond.asobject() if hasattr(cond, "asobject") else cond  # (a == b is built lazily)
        dtype = ir.expr_dtype(cond) if not isinstance(cond, bool) else "bool"
        if dtype != "bool":
            raise error(user_loc(), f"T.when: the condition {cond} is {dtype}; accepted: a comparison or a "
                                    f"boolean expression (i < n, T.And(...))")
        self.cond = tirx.const(cond, "bool") if isinstance(cond, bool) else cond

    def __enter__(self):
        ir.tracer().masks.append(self.cond)

    def __exit__(self, *exc):
        ir.tracer().masks.pop()


# ----------------------------------------------------------------------------- tile ops


EVICTION_POLICIES = ("evict_first", "evict_last")


def copy(src, dst, eviction_policy=None):
    """Copy a tile between global / shared / fragment; casts when dtypes differ; predicated at edges.
    ``eviction_policy`` (a global -> shared copy): the L2 priority of the lines it reads, as in Triton's
    ``tl.load``: "evict_first" for data read once (decode's weights), so it leaves the L2's other lines in
    place; "evict_last" for data read again.  TMA and cp.async loads carry it; a copy lowered to plain
    loads (a cast, rows too narrow for cp.async) reads with the normal priority."""
    src, dst = Region.of(src), Region.of(dst)
    if eviction_policy is not None:
        if eviction_policy not in EVICTION_POLICIES:
            raise error(user_loc(), f"T.copy: eviction_policy={eviction_policy!r}; accepted: None, "
                                    f"{', '.join(map(repr, EVICTION_POLICIES))}")
        if src.buffer.scope != "global" or dst.buffer.scope != "shared":
            raise error(user_loc(), f"T.copy: eviction_policy applies to a copy from global into shared memory, "
                                    f"got {src.buffer.scope} -> {dst.buffer.scope}")
    emit(Copy(src, dst, eviction_policy))


def atomic_add(dst, src):
    """``dst += src`` for a tile, each element's addition atomic: a float32 fragment or shared tile added into a
    float32 window of a global tensor (``dst``: a region or a start point, as in ``T.copy``) that other blocks
    add into too, such as split-K partial sums or FlashAttention's dQ.  Predicated at the tensor's edges."""
    src, dst = Region.of(src), Region.of(dst)
    if dst.buffer.scope != "global" or src.buffer.scope not in ("fragment", "shared"):
        raise error(user_loc(), f"T.atomic_add: adds a fragment or shared tile into a global tensor; got "
                                f"{src.buffer.name} ({src.buffer.scope}) into {dst.buffer.name} ({dst.buffer.scope})")
    if dst.buffer.dtype != "float32" or src.buffer.dtype != "float32":
        raise error(user_loc(), f"T.atomic_add: float32 into float32; got {src.buffer.name} ({src.buffer.dtype}) "
                                f"into {dst.buffer.name} ({dst.buffer.dtype})")
    emit(AtomicAdd(src, dst))


def gemm(A, B, C, transpose_A=False, transpose_B=False, clear_accum=False, policy="square"):
    """``C += op(A) @ op(B)`` for a block: A shared or fragment, B shared, C a float32 fragment."""
    for x, role in ((A, "A"), (B, "B"), (C, "C")):
        if not isinstance(x, TileBuffer):
            raise error(user_loc(), f"T.gemm operand {role} must be a whole buffer, got {type(x).__name__}")
    emit(Gemm(A, B, C, bool(transpose_A), bool(transpose_B), bool(clear_accum), policy))


def fill(buffer, value):
    emit(Fill(_whole(buffer, "T.fill"), value))


def clear(buffer):
    emit(Fill(_whole(buffer, "T.clear"), 0))


def reduce_max(src, dst, dim=-1, clear=True):
    emit(Reduce("max", _whole(src, "T.reduce_max"), _whole(dst, "T.reduce_max"), dim, clear))


def reduce_min(src, dst, dim=-1, clear=True):
    emit(Reduce("min", _whole(src, "T.reduce_min"), _whole(dst, "T.reduce_min"), dim, clear))


def reduce_sum(src, dst, dim=-1, clear=True):
    emit(Reduce("sum", _whole(src, "T.reduce_sum"), _whole(dst, "T.reduce_sum"), dim, clear))


def _whole(buffer, op: str) -> TileBuffer:
    """``buffer`` when it is a whole tile: these ops take no regions."""
    if not isinstance(buffer, TileBuffer):
        what = f"a region of {buffer.buffer.name}" if isinstance(buffer, Region) else type(buffer).__name__
        raise error(user_loc(), f"{op} takes whole buffers, got {what}; accepted: a buffer from T.alloc_* (for part "
                                f"of one, assign its elements in a T.Parallel over that part)")
    return buffer


def _grid_extent(e):
    """A T.Kernel grid extent: a compile-time int, or an int expression of the program's T.dynamic sizes
    (evaluated at each launch)."""
    v = e if isinstance(e, float) else ir.tirx_simplify(e)
    if isinstance(v, int) or hasattr(v, "value"):
        return _static_extent(v, "T.Kernel grid")
    if "int" not in ir.expr_dtype(v):
        raise error(user_loc(), f"T.Kernel grid extent {e} is not an integer (// divides integers)")
    dims = {d.name for d in ir.tracer().dims}
    others = [str(x) for x in tirx.analysis.undefined_vars(v, []) if x.name not in dims]
    if others:
        raise error(user_loc(), f"T.Kernel grid extent {e} depends on {', '.join(others)}; accepted: ints and the "
                                f"program's T.dynamic sizes")
    return v


def _static_extent(e, op: str) -> int:
    """An extent the compiler must know: an integer, or an expression of compile-time constants."""
    v = e if isinstance(e, float) else ir.tirx_simplify(e)
    if isinstance(v, float) or "float" in str(getattr(v, "ty", "")):
        raise error(user_loc(), f"{op} extent {e} is not an integer (// divides integers)")
    if not isinstance(v, int) and not hasattr(v, "value"):
        raise error(user_loc(), f"{op} extent {e} depends on values known only when the kernel runs; accepted: "
                                f"a compile-time integer (a factory argument, or arithmetic on them)")
    return int(v if isinstance(v, int) else v.value)


_COMBINE = {"max": lambda blocks: functools.reduce(max, [v for v, in blocks]),
            "sum": lambda blocks: functools.reduce(operator.add, [v for v, in blocks])}


def cluster_allreduce(buffers, op):
    """Reduce float32 fragments elementwise over the blocks of the kernel's cluster (``T.Kernel(...,
    cluster=n)``), in one exchange through their shared memory; every block gets the result.

    ``buffers``: a fragment, or a tuple of fragments of one shape that travel together.  ``op``: "max" or
    "sum" (one fragment), or a function ``combine(blocks)`` that returns the reduced value of each buffer (a
    tuple, or one value) from ``blocks``, block j's values (``blocks[j][i]``: buffer i's), written with the
    language's scalar functions (T.max, T.exp2, T.if_then_else, ...); it is called once, while tracing, on
    symbolic values.  E.g. merging softmax row statistics (max in log2 units, sum of 2^(x - max))::

        def merge(blocks):
            top = functools.reduce(T.max, [m for m, _ in blocks])
            return top, sum(T.where(m == -T.infinity("float32"), 0.0, l * T.exp2(m - top)) for m, l in blocks)

        T.cluster_allreduce((row_max, row_sum), merge)"""
    buffers = tuple(buffers) if isinstance(buffers, (tuple, list)) else (buffers,)
    if isinstance(op, str):
        if op not in _COMBINE or len(buffers) != 1:
            raise error(user_loc(), f"T.cluster_allreduce: op={op!r}; accepted: 'max' or 'sum' (of one fragment), or "
                                    f"a function combine(blocks) returning one value per buffer")
        op = _COMBINE[op]
    elif not callable(op):
        raise error(user_loc(), f"T.cluster_allreduce: op={op!r}; accepted: 'max', 'sum' or a function "
                                f"combine(blocks)")
    _check_cluster_exchange("T.cluster_allreduce", buffers)
    n = ir.tracer().kernel.cluster[0]
    peers = [[tirx.Var(f"block{j}_{b.name}", "float32") for b in buffers] for j in range(n)]
    results = op([tuple(p) for p in peers])
    results = tuple(results) if isinstance(results, (tuple, list)) else (results,)
    if len(results) != len(buffers):
        raise error(user_loc(), f"T.cluster_allreduce: combine returned {len(results)} value(s) for {len(buffers)} "
                                f"buffer(s); accepted: one value per buffer, in their order")
    emit(ClusterReduce(buffers, peers, tuple(r if ir.expr_dtype(r) == "float32" else cast(r, "float32")
                                             for r in results)))


def row_reduce_store(tile, stats, combine, scale, staged, dst):
    """Store ``tile`` (a float32 fragment) to ``dst`` with each row multiplied by ``scale(own, total)``, where
    ``own`` is this block's row statistics ``stats`` (row fragments of the tile, e.g. from T.reduce_*) and
    ``total`` is ``combine`` of them over every tile of the row: the blocks of the grid's x axis with this
    block's y.  A row split over many CTAs without a cluster, normalized once all of them are in: a softmax
    (``stats`` its max and sum, ``combine`` their merge, ``scale`` 2^(own max - max) / sum), or a norm.

    ``combine(blocks)``: one value per stat (a tuple, or one value) from ``blocks``, block j's values (a
    tuple: ``blocks[j][v]`` is stat v); ``scale(own, total)``: the row's multiplier.  Both are written with
    the language's scalar functions and called once, while tracing, on symbolic values.

    Every block publishes its rows' statistics to global memory; the tile waits in ``staged`` (a shared tile)
    and is stored, scaled, once the row's other tiles have published theirs, after the block's next tile:
    the CTAs walk the tiles in grid order (persistent, without rasterization), so a row's tiles run at the
    same time, and a warp of the producer warpgroup waits for the statistics and computes each row's factor
    while the consumers compute the next tile.  sm_90a (warp-specialized) only; a row of at most 16 tiles.
    The CTAs wait on each other: all must be resident at once (the launcher sizes the grid to the device's
    SMs; SMs that another kernel holds meanwhile delay the rows they wait on)."""
    t = ir.tracer()
    k = t.kernel
    stats = tuple(stats) if isinstance(stats, (tuple, list)) else (stats,)
    if not isinstance(tile, TileBuffer) or tile.scope != "fragment" or tile.dtype != "float32" or len(tile.shape) != 2:
        raise error(user_loc(), "T.row_reduce_store: tile must be a whole 2-D float32 fragment")
    for s in stats:
        if not isinstance(s, TileBuffer) or s.scope != "fragment" or s.dtype != "float32" or s.shape != tile.shape[:1]:
            raise error(user_loc(), f"T.row_reduce_store: the stats must be float32 fragments of the tile's rows "
                                    f"({tile.shape[0]},), got {getattr(s, 'name', s)!s}")
    if not isinstance(staged, TileBuffer) or staged.scope != "shared" or staged.shape != tile.shape:
        raise error(user_loc(), f"T.row_reduce_store: staged must be a shared tile of the tile's shape {tile.shape}")
    if (len(k.grid) != 2 or k.cluster != (1, 1) or k.pingpong or k.stream_k or not k.persistent
            or k.swizzle_panel):
        raise error(user_loc(), "T.row_reduce_store needs T.Kernel(column tiles, row blocks, ...) over a 2-D grid, "
                                "persistent, without cluster, pingpong, stream_k or T.use_swizzle (the CTAs walk "
                                "the tiles in grid order so that a row's tiles run at the same time)")
    if not isinstance(k.grid[0], int):
        raise error(user_loc(), f"T.row_reduce_store: the tiles of a row (grid x: {k.grid[0]}) must be a "
                                f"compile-time count (the rows, grid y, may be T.dynamic)")
    if k.grid[0] > MAX_ROW_TILES:
        raise error(user_loc(), f"T.row_reduce_store: {k.grid[0]} tiles a row; at most {MAX_ROW_TILES}, so that "
                                f"a row's tiles run on distinct CTAs of any Hopper grid (even a "
                                f"{MAX_ROW_TILES}-SM MIG slice)")
    if len(t.bodies) > 1 or any(isinstance(n, ir.RowReduceStore) for n in k.body):
        raise error(user_loc(), "T.row_reduce_store: once per tile, at the kernel's top level")
    own = [tirx.Var(f"own_{s.name}", "float32") for s in stats]
    peers = [[tirx.Var(f"block{j}_{s.name}", "float32") for s in stats] for j in range(k.grid[0])]
    total = combine([tuple(p) for p in peers])
    total = tuple(total) if isinstance(total, (tuple, list)) else (total,)
    factor = scale(tuple(own), total)
    factor = factor if ir.expr_dtype(factor) == "float32" else cast(factor, "float32")
    bM, bN = tile.shape
    factors = ir.new_buffer((2, bM), "float32", "shared", name="row_factors")
    slot = tirx.Var("factor_slot", "int32")
    node = emit(ir.RowReduceStore(tile, stats, own, peers, factor, staged, factors, slot))
    t.bodies.append(node.body)
    try:
        copy(tile, staged)
        for r, c in Parallel(bM, bN):
            staged[r, c] = staged[r, c] * factors[slot, r]
        copy(staged, dst)
    finally:
        t.bodies.pop()


def _cluster_dims(cluster, grid) -> tuple:
    """(cx, cy) of T.Kernel's ``cluster``: an int n is (n, 1); each must divide its grid extent."""
    extents = list(grid[:2]) + [1] * (2 - len(grid[:2]))
    try:
        dims = tuple(map(operator.index, cluster if isinstance(cluster, (tuple, list)) else (cluster, 1)))
    except TypeError:
        dims = ()
    if (len(dims) != 2 or builtins.min(dims) < 1 or math.prod(dims) > MAX_CLUSTER
            or not all(_divides(d, e) for e, d in zip(extents, dims))):
        hint = "" if all(isinstance(e, int) for e in extents) else \
            "; a T.dynamic extent divides when written so, e.g. T.ceildiv(M, 2 * bM) * 2"
        raise error(user_loc(), f"cluster={cluster}: n or (cx, cy) blocks, at most {MAX_CLUSTER} in all (the "
                                f"portable cluster size), each dividing its grid extent (grid {extents}{hint})")
    return dims


def _divides(d: int, e) -> bool:
    """Whether ``d`` divides the extent ``e`` for every value of the program's T.dynamic sizes."""
    if isinstance(e, int):
        return e % d == 0
    from tvm.sym.analyzer import Analyzer

    return Analyzer().can_prove(tirx.floormod(e, d) == 0)


def _check_cluster_exchange(name, buffers):
    if len({id(b) for b in buffers}) != len(buffers):
        raise error(user_loc(), f"{name}: a fragment is given twice; accepted: distinct fragments")
    for b in buffers:
        if not isinstance(b, TileBuffer) or b.scope != "fragment" or b.dtype != "float32":
            raise error(user_loc(), f"{name}: {getattr(b, 'name', b)!s} must be a whole float32 fragment")
    t = ir.tracer()
    if t.kernel is None or t.kernel.cluster[0] == 1 or t.kernel.cluster[1] != 1:
        raise error(user_loc(), f"{name} needs a kernel clustered along x: T.Kernel(..., cluster=n) with n > 1")
    if len(t.bodies) > 1:  # exchange slots alternate per tile, not per loop iteration
        raise error(user_loc(), f"{name} must be at the kernel's top level, not inside a loop "
                                "(combine once per tile, after the loop)")
    if len({b.shape for b in buffers}) > 1:
        raise error(user_loc(), f"{name}: {', '.join(f'{b.name}{list(b.shape)}' for b in buffers)}: the fragments "
                                f"must have one shape")


def use_swizzle(panel_size: int = 8):
    """Rasterize blocks in panels of ``panel_size`` rows of the grid, so neighbours share L2 tiles."""
    k = ir.tracer().kernel
    if k is None or len(k.grid) < 2:
        raise error(user_loc(), "T.use_swizzle needs a 2-D T.Kernel grid")
    if int(panel_size) < 1:
        raise error(user_loc(), f"T.use_swizzle: panel_size={panel_size}; accepted: 1 or more grid rows")
    k.swizzle_panel = int(panel_size)


# ----------------------------------------------------------------------------- scalars


def ceildiv(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return tirx.ceildiv(a, b)


def cast(x, dtype):
    return tirx.Cast(str(dtype), x) if not isinstance(x, (int, float)) else tirx.const(x, str(dtype))


def infinity(dtype):
    return tirx.infinity(str(dtype))


def max(a, b):  # noqa: A001
    return tirx.max(a, b) if not (isinstance(a, (int, float)) and isinstance(b, (int, float))) else builtins.max(a, b)


def min(a, b):  # noqa: A001
    return tirx.min(a, b) if not (isinstance(a, (int, float)) and isinstance(b, (int, float))) else builtins.min(a, b)


def if_then_else(cond, a, b):
    """``a`` where ``cond`` holds, else ``b``, evaluating only the side taken (a branch)."""
    return tirx.if_then_else(cond, a, b)


def where(cond, a, b):
    """``a`` where ``cond`` holds, else ``b``, both evaluated (a select, as Triton's ``tl.where``): no branch,
    for cheap sides."""
    dtype = ir.expr_dtype(a) if not isinstance(a, (int, float)) else ir.expr_dtype(b)
    as_expr = lambda x: tirx.const(x, dtype) if isinstance(x, (int, float)) else x  # noqa: E731
    return tirx.Select(cond, as_expr(a), as_expr(b))


def _floating(fn):
    """``fn`` (tirx.exp, ...) refusing a non-floating argument at the user's line, not in nvcc's output."""
    def checked(x, *rest):
        dtype = ir.expr_dtype(x)
        if dtype.startswith(("int", "uint", "bool")):
            raise error(user_loc(), f"T.{fn.__name__}: needs a floating point argument, got {dtype} "
                                    f"(T.cast(x, 'float32') first)")
        return fn(x, *rest)

    checked.__name__ = checked.__qualname__ = fn.__name__
    return checked


# a float32 exp2 compiles to ex2.approx.ftz (2 ulp, subnormal results flushed to 0; compiler/lower.py); the
# others to CUDA's libdevice functions (expf, rsqrtf, erff, ...)
exp, exp2, log, log2, log1p, sqrt, rsqrt = map(_floating, (tirx.exp, tirx.exp2, tirx.log, tirx.log2, tirx.log1p,
                                                            tirx.sqrt, tirx.rsqrt))
tanh, sigmoid, erf, sin, cos, tan, atan = map(_floating, (tirx.tanh, tirx.sigmoid, tirx.erf, tirx.sin, tirx.cos,
                                                          tirx.tan, tirx.atan))
floor, ceil, round, trunc = map(_floating, (tirx.floor, tirx.ceil, tirx.round, tirx.trunc))  # noqa: A001


def pow(x, y):  # noqa: A001
    """``x`` to the power ``y`` (floating ``x``; CUDA's powf)."""
    return _floating(tirx.pow)(x, y)
abs = tirx.abs  # noqa: A001
