"""tirx expressions: a small rewriter (substitute variables, remap buffer loads, calls), and the index and
vector helpers the lowering shares."""

from __future__ import annotations

from typing import Callable

import tvm.ir.expr as irx
import tvm.ir.prim.expr as px
from tvm import tirx

from ..lang import known_multiple

LoadFn = Callable[[object, list], object]  # (buffer var, new indices) -> replacement expr or None


def rewrite(expr, var_map: dict | None = None, on_load: LoadFn | None = None, on_call: Callable | None = None,
            on_select: Callable | None = None):
    """Return ``expr`` with vars replaced by ``var_map``, buffer loads by ``on_load``, calls by
    ``on_call(call with rewritten args)`` and selects by ``on_select(select)`` (a replacement expr or None)."""
    var_map = var_map or {}

    def go(e):
        if isinstance(e, (int, float, bool)) or e is None:
            return e
        if isinstance(e, irx.TensorLoad):
            idx = [go(i) for i in e.indices]
            if on_load is not None:
                new = on_load(e.source, idx)
                if new is not None:
                    return new
            return tirx.BufferLoad(e.source, idx)
        if isinstance(e, irx.Var):
            for k, v in var_map.items():
                if k.same_as(e):
                    return v
            return e
        if isinstance(e, (px.IntImm, px.FloatImm, irx.StringImm)):
            return e
        if isinstance(e, px.BinaryOpExpr) or isinstance(e, (px.CmpExpr, px.LogicalExpr)) and hasattr(e, "b"):
            return type(e)(go(e.a), go(e.b))
        if isinstance(e, px.Not):
            return px.Not(go(e.a))
        if isinstance(e, px.Cast):
            return tirx.Cast(str(e.ty), go(e.value))
        if isinstance(e, px.Select):
            new = on_select(e) if on_select is not None else None
            if new is not None:
                return go(new)
            return tirx.Select(go(e.condition), go(e.true_value), go(e.false_value))
        if isinstance(e, irx.Call):
            call = irx.Call(e.op, [go(a) for a in e.args], attrs=e.attrs, ret_ty=e.ty)
            new = on_call(call) if on_call is not None else None
            return call if new is None else new
        raise TypeError(f"tile_ops: cannot rewrite expression node {type(e).__name__}: {e}")

    return go(expr)


_PYTHON_OPS = {px.Add: "+", px.Sub: "-", px.Mul: "*", px.FloorDiv: "//", px.FloorMod: "%"}


def to_python(e):
    """An int expression of the program's T.dynamic sizes as KernelMeta keeps it: an int where it is constant,
    else a Python expression of their names (floor division and modulo, as TIR's)."""
    if isinstance(e, int):
        return e
    from tvm.sym.analyzer import Analyzer

    e = Analyzer().simplify(e)

    def go(x):
        if isinstance(x, px.IntImm):
            return str(int(x.value))
        if isinstance(x, irx.Var):
            return x.name
        if type(x) in _PYTHON_OPS:
            return f"({go(x.a)} {_PYTHON_OPS[type(x)]} {go(x.b)})"
        if isinstance(x, (px.Min, px.Max)):
            return f"{type(x).__name__.lower()}({go(x.a)}, {go(x.b)})"
        raise TypeError(f"tile_ops: a launch-time size must be integer arithmetic of T.dynamic sizes, got {x}")

    return int(e.value) if isinstance(e, px.IntImm) else go(e)


def at_most(e, n: int) -> bool:
    """Whether ``e`` (an int, or an expression of T.dynamic sizes) is at most ``n`` for every value they take."""
    if isinstance(e, int):
        return e <= n
    from tvm.sym.analyzer import Analyzer

    return Analyzer().can_prove(e <= n)


def divides(n: int, dim) -> bool:
    """Whether ``n`` divides a tensor dimension: an int, or a T.dynamic size by its declared ``multiple_of``."""
    return known_multiple(dim) % n == 0


def _row_major(dims) -> list:
    """The strides of a row-major tensor of ``dims``: the products of the dims after each."""
    strides = [1]
    for d in reversed(dims[1:]):
        strides.insert(0, strides[0] * d)
    return strides


def strides_of(buf) -> list:
    """A global tensor's strides in elements (ints or expressions of T.dynamic sizes): its declared ones, else
    row-major."""
    return list(buf.strides) if buf.strides is not None else _row_major(list(buf.shape))


def stride_multiples(buf) -> list:
    """What each of a global tensor's strides is known to be a multiple of (``known_multiple``, per stride)."""
    if buf.strides is not None:
        return [known_multiple(s) for s in buf.strides]
    return _row_major([known_multiple(d) for d in buf.shape])


def rows_divisible(n: int, buf) -> bool:
    """Whether a global tensor's last dim and every stride but the last are multiples of ``n`` elements: then
    an ``n``-aligned column starts an aligned run of ``n`` in every row, wholly in or out of bounds."""
    return divides(n, buf.shape[-1]) and all(m % n == 0 for m in stride_multiples(buf)[:-1])


def smin(a, b):
    """min of two ints or expressions."""
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else tirx.min(a, b)


def collect_loads(expr) -> list:
    """Every buffer load in ``expr`` as (buffer var, indices)."""
    found = []

    def on_load(buf, idx):
        found.append((buf, idx))
        return None

    rewrite(expr, on_load=on_load)
    return found


def conjunction(conds: list):
    """``conds[0] && conds[1] && ...`` (a non-empty list of conditions)."""
    out = conds[0]
    for c in conds[1:]:
        out = tirx.And(out, c)
    return out


def uses(e, var) -> bool:
    """Whether expression ``e`` mentions ``var``."""
    from tvm.tirx.analysis import undefined_vars

    return not isinstance(e, (int, float)) and any(v.same_as(var) for v in undefined_vars(e))


def dtype_bits(dtype: str) -> int:
    import tvm

    return tvm.runtime.DataType(dtype).bits


def cast(v, dtype):
    """``v`` as ``dtype`` (per lane, for a vector)."""
    if isinstance(v, (int, float)):
        return tirx.const(v, dtype)
    dtype = vector_type(dtype, v.ty.dtype.lanes)
    return v if str(v.ty) == dtype else tirx.Cast(dtype, v)


def broadcast(v, vec):
    return tirx.Broadcast(v, vec) if vec > 1 and v.ty.dtype.lanes == 1 else v


def widest(bits: int, fits) -> int:
    """Elements per access: the widest of 16, 8 and 4 bytes that ``fits(vec)``, else 1."""
    return next((v for v in (128 // bits, 64 // bits, 32 // bits) if v > 1 and fits(v)), 1)


def broadcastable(bits: int, vec: int) -> bool:
    """Whether a scalar of ``bits`` can be broadcast to ``vec`` lanes: TVM's CUDA code builds 8 or 16 lanes of
    8-bit values with a make_int2/make_int4 of 8 or 16 arguments, which nvcc refuses."""
    return bits > 8 or vec <= 4


def ramp(base, vec):
    return tirx.Ramp(base, 1, vec) if vec > 1 else base


def vector_type(dtype: str, vec: int) -> str:
    return f"{dtype}x{vec}" if vec > 1 else dtype


def vector_load(buf, idx, vec):
    return tirx.BufferLoad(buf, idx[:-1] + [ramp(idx[-1], vec)])


def squeeze(extents) -> list:
    """Extents without leading 1s: a (1, M, K) window of a 3-D tensor matches an (M, K) tile."""
    ext = list(extents)
    while len(ext) > 1 and ext[0] == 1:
        ext.pop(0)
    return ext


def pad(idx, like) -> list:
    """Tile coordinates for a side of higher rank: leading dims at offset 0."""
    return [0] * (len(like) - len(idx)) + list(idx)


def unflatten(r, shape):
    idx = []
    for s in reversed(shape):
        idx.append(tirx.floormod(r, s))
        r = tirx.floordiv(r, s)
    return list(reversed(idx))


def flat_index(idx, shape):
    flat = idx[0]
    for i, d in zip(idx[1:], shape[1:]):
        flat = flat * d + i
    return flat


def as_int32(x):
    return x if isinstance(x, int) else (x if str(x.ty) == "int32" else tirx.Cast("int32", x))


def is_vars(idx, vars_) -> bool:
    """Whether ``idx`` is exactly the variables ``vars_``, in order."""
    return len(idx) == len(vars_) and all(isinstance(i, irx.Var) and i.same_as(v) for i, v in zip(idx, vars_))


def reads_memory(e) -> bool:
    """Whether an index expression reads a buffer (so only the threads holding its values can evaluate it)."""
    return not isinstance(e, (int, float)) and bool(collect_loads(e))


_SUMS = (px.Add, px.Mul, px.FloorDiv, px.Div, px.Min, px.BitwiseAnd, px.BitwiseOr, px.RShift, px.LShift)


def nonneg(e) -> bool:
    """Whether index ``e`` is >= 0 by its form.  Every integer variable of a lowered program is an index
    (thread and block ids, loop counters from 0, counts the compiler binds), so only a subtraction or a
    negative constant makes an index negative (the analyzer knows no variable's range)."""
    if isinstance(e, int):
        return e >= 0
    if isinstance(e, px.IntImm):
        return e.value >= 0
    if isinstance(e, px.Var):
        return True
    if isinstance(e, _SUMS):
        return nonneg(e.a) and nonneg(e.b)
    if isinstance(e, px.FloorMod):  # floormod takes the divisor's sign
        return nonneg(e.b)
    if isinstance(e, px.Max):
        return nonneg(e.a) or nonneg(e.b)
    if isinstance(e, px.Cast):
        return nonneg(e.value)
    if isinstance(e, px.Select):
        return nonneg(e.true_value) and nonneg(e.false_value)
    if isinstance(e, irx.Call):
        op = getattr(e.op, "name", "")
        if op.endswith("if_then_else"):
            return nonneg(e.args[1]) and nonneg(e.args[2])
        if op == "tirx.cuda.func_call":
            name = e.args[0].value
            return name == "tile_ops_grid_x" or name == "tile_ops_warp_uniform" and nonneg(e.args[1])
    return False
