"""A small rewriter for tirx expressions: substitute variables and remap buffer loads."""

from __future__ import annotations

from typing import Callable

import tvm.ir.expr as irx
import tvm.ir.prim.expr as px
from tvm import tirx

LoadFn = Callable[[object, list], object]  # (buffer var, new indices) -> replacement expr or None


def rewrite(expr, var_map: dict | None = None, on_load: LoadFn | None = None, on_call: Callable | None = None):
    """Return ``expr`` with vars replaced by ``var_map``, buffer loads by ``on_load`` and calls by
    ``on_call(call with rewritten args)`` (a replacement expr or None)."""
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
            return tirx.Select(go(e.condition), go(e.true_value), go(e.false_value))
        if isinstance(e, irx.Call):
            call = irx.Call(e.op, [go(a) for a in e.args], attrs=e.attrs, ret_ty=e.ty)
            new = on_call(call) if on_call is not None else None
            return call if new is None else new
        raise TypeError(f"tile_ops: cannot rewrite expression node {type(e).__name__}: {e}")

    return go(expr)


def collect_loads(expr) -> list:
    """Every buffer load in ``expr`` as (buffer var, indices)."""
    found = []

    def on_load(buf, idx):
        found.append((buf, idx))
        return None

    rewrite(expr, on_load=on_load)
    return found


def uses(e, var) -> bool:
    """Whether expression ``e`` mentions ``var``."""
    from tvm.tirx.analysis import undefined_vars

    return not isinstance(e, (int, float)) and any(v.same_as(var) for v in undefined_vars(e))
