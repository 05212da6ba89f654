"""``T.Parallel(*extents)``: element assignments over a tile.  Over a fragment the loop takes the
fragment's layout (each thread its own elements, by register); otherwise the iteration space is spread
over the block's threads, as wide vectors along the last loop variable as every access allows."""

from __future__ import annotations

import contextlib

import tvm.ir.prim.expr as px
from tvm import tirx
from tvm.ir.expr import TensorLoad
from tvm.tirx.script import builder as T

from ...lang.ir import Parallel, Store, TileLangError, error, walk
from ..exprs import (broadcast, broadcastable, cast, collect_loads, conjunction, dtype_bits, is_vars, rewrite, uses,
                     widest)
from ..layout import MmaAccumLayout, MmaRowLayout
from . import Container, tile_op
from .store import loaded


@tile_op(Parallel)
class ParallelOp(Container):
    def propagate(self, inf, node):
        anchor = _anchor(inf, node)
        changed = False
        if anchor is not None:
            for buf, kind in _fragments_in(inf, node):
                want = anchor if kind == "full" else _row_of(anchor, node)
                if want is not None and buf not in inf.layouts:
                    changed |= inf.assign(buf, want, node)
        return changed

    def joined(self, inf, node):
        return [b for b, kind in _fragments_in(inf, node) if kind == "full"]

    def check(self, inf, node):
        if id(node) not in inf.parallel:
            inf.parallel[id(node)] = _anchor(inf, node)
        _check_rows(inf, node, inf.parallel[id(node)])

    def lower(self, lw, node, vm):
        _check_inside(lw, node)
        whole = _whole_tile_inside(lw, node, vm)
        settled, holds = _selects_settled_on_tile(lw, node, vm)
        if whole is None and not settled:
            return _lower(lw, node, vm)
        # an interior tile, the common case, runs without a predicate or a select per element
        with T.If(conjunction([c for c in (whole, holds) if c is not None])):
            with T.Then():
                with lw.bounds_known() if whole is not None else contextlib.nullcontext():
                    _lower(lw, node, vm, _true_sides(node.body, settled))
            with T.Else():
                _lower(lw, node, vm)


def _lower(lw, node, vm, body=None):
    """``node``'s statements (``body``: others in their place, e.g. with settled selects) over its tile."""
    body = node.body if body is None else body
    anchor = lw.infer.parallel.get(id(node))
    if anchor is None:  # no fragment: spread the iteration space over the threads, vec columns each
        vec = _vector_width(lw, node)

        def run(idx):
            inner = {**vm, **dict(zip(node.vars, idx))}
            for st in body:
                _store(lw, st, inner, None, node, vec)
        return lw.flat_loop(node.extents, run, vec)
    with T.unroll(0, anchor.local_size) as r:
        coords = anchor.coords(lw.tid, r)
        inner = {**vm, **dict(zip(node.vars, coords))}

        def frag_index(buf, idx, _r=r):
            lay = lw.infer.layouts[buf]
            if lay == anchor:
                return _r
            if isinstance(lay, MmaRowLayout) and isinstance(anchor, MmaAccumLayout):  # checked in inference
                return lay.row_of_accum_local(_r, anchor)
            raise TileLangError(f"fragment {buf.name} does not share the loop's layout")

        for st in body:
            _store(lw, st, inner, frag_index, node)


# ---------------------------------------------------------------------- layouts


def _fragments_in(inf, node: Parallel):
    """Fragments accessed in a T.Parallel body: 'full' when indexed by all loop vars in order,
    'row' when a 1-D fragment is indexed by the first loop var."""
    out = []

    def classify(buf, idx, loc):
        if buf.scope != "fragment":
            return
        if is_vars(idx, node.vars):
            out.append((buf, "full"))
        elif len(idx) == 1 and len(node.vars) == 2 and is_vars(idx, node.vars[:1]):
            out.append((buf, "row"))
        else:
            raise error(loc, f"inside T.Parallel, fragment {buf.name} must be indexed by the loop variables "
                             f"({', '.join(str(v) for v in node.vars)})")

    for st in node.body:
        if not isinstance(st, Store):
            raise error(st.loc, "only element assignments are allowed inside T.Parallel")
        classify(st.buffer, st.indices, st.loc)
        for buf_var, idx in _loads(st):
            buf = inf.buffers.get(buf_var)
            if buf is not None:
                classify(buf, idx, st.loc)
    return out


def _row_of(anchor, node):
    if len(node.vars) == 1:
        return anchor
    if isinstance(anchor, MmaAccumLayout):
        return anchor.row_layout()
    return None


def _anchor(inf, node):
    full = [inf.layouts[b] for b, k in _fragments_in(inf, node) if k == "full" and b in inf.layouts]
    if not full:
        return None
    first = full[0]
    for lay in full[1:]:
        if lay != first:
            raise error(node.loc, "T.Parallel mixes fragments with different layouts")
    if list(first.shape) != list(node.extents):
        raise error(node.loc, f"T.Parallel extents {node.extents} differ from the fragment shape {list(first.shape)}")
    return first


def _check_rows(inf, node: Parallel, anchor) -> None:
    """A 1-D fragment read by row inside T.Parallel over an accumulator must hold each thread's rows of
    that accumulator: a statistic of S may rescale O (another width, the same warp rows), not an
    accumulator whose rows sit in other threads."""
    if len(node.vars) != 2:
        return
    for buf, kind in _fragments_in(inf, node):
        lay = inf.layouts[buf]
        if kind != "row" or isinstance(anchor, MmaAccumLayout) and isinstance(lay, MmaRowLayout) and (
                lay.holds_rows_of(anchor)):
            continue
        if not isinstance(anchor, MmaAccumLayout):
            raise error(node.loc, f"fragment {buf.name} is read by row in a T.Parallel whose 2-D fragments "
                                  f"{'no gemm laid out' if anchor else 'are none'}: a row value (what "
                                  f"T.reduce_* writes) applies to a gemm's accumulator, or one copied from it")
        w = anchor.w
        held = (f"the rows of a {lay.accum.w.M}x{lay.accum.w.N} accumulator over {lay.accum.w.wm}x"
                f"{lay.accum.w.wn} warps" if isinstance(lay, MmaRowLayout) else f"a {lay.kind} layout")
        raise error(node.loc, f"fragment {buf.name} holds {held}, but this T.Parallel's {w.M}x{w.N} "
                              f"accumulator is over {w.wm}x{w.wn} warps (along M x N): a row value can "
                              f"only scale an accumulator whose rows sit in the same threads; give both "
                              f'gemms policy="full_row" (every warp along M)')


# ---------------------------------------------------------------------- lowering


def _check_inside(lw, node: Parallel):
    """Shared and local tiles are not predicated: an index T.Parallel takes past a tile's end (or before
    its start) at some iteration, the first or the last, would write or read a neighbouring tile."""
    ends = [{v: 0 for v in node.vars}, {v: e - 1 for v, e in zip(node.vars, node.extents)}]
    for st in (n for n in walk(node.body) if isinstance(n, Store)):
        accesses = [(st.buffer, st.indices)] + [(lw.buffers.get(b), idx) for b, idx in _loads(st)]
        for buf, idx in accesses:
            if buf is None or buf.scope not in ("shared", "local"):
                continue
            for d, (i, dim) in enumerate(zip(idx, buf.shape)):
                if isinstance(i, int):
                    i = tirx.const(i, "int32")
                first, last = (rewrite(i, at) for at in ends)
                if lw.ana.can_prove(tirx.Or(first < 0, last >= dim)):
                    raise error(st.loc, f"{buf.name}{list(buf.shape)}: T.Parallel{tuple(node.extents)} indexes "
                                        f"dim {d} from {lw.ana.simplify(first)} to {lw.ana.simplify(last)}, "
                                        f"outside 0..{dim - 1} (shared and local tiles are not predicated, only "
                                        f"global tensors are)")


def _whole_tile_inside(lw, node, vm):
    """The condition that every global element the T.Parallel touches lies inside its tensor, where the
    per-element predicates hang on a runtime size (``T.dynamic``): one test per tile, so an interior tile's
    loads are all in flight at once (predicated one by one, each row waited for its load).  Each index
    must grow with every loop variable, so its first and last iterations bound it; None otherwise."""
    first = {v: 0 for v in node.vars}
    last = {v: e - 1 for v, e in zip(node.vars, node.extents)}
    conds = []
    for st in (n for n in walk(node.body) if isinstance(n, Store)):
        for buf, idx in [(st.buffer, st.indices)] + [(lw.buffers.get(b), i) for b, i in _loads(st)]:
            if buf is None or buf.scope != "global":
                continue
            for i, dim in zip(idx, buf.shape):
                if isinstance(i, int):
                    continue
                if _rises(lw, node, i) != [True] * len(node.vars):
                    return None
                lo, hi = (lw.ana.simplify(lw.expr(rewrite(i, at), vm)) for at in (first, last))
                conds += [c for c in (lo >= 0, hi < dim) if not lw.ana.can_prove(c)]
    conds = list({str(c): c for c in conds}.values())  # a tensor read and written at the same index
    if not conds or not any(uses(c, d) for c in conds for d in lw.prog.dims):
        return None
    return conjunction(conds)


def _selects_settled_on_tile(lw, node, vm):
    """(settled, test): the ``T.where`` selects and ``T.when`` masks of the body whose condition is a conjunction
    of integer comparisons, each monotone in the loop variables, and the test that every one of them holds on
    the whole tile (a comparison's worst corner bounds it): a mask's interior tiles then skip it."""
    settled, tests = [], []

    def settle(e, cond):
        test = _holds_on_tile(lw, node, cond, vm)
        if test is not None and not any(e.same_as(s) for s in settled):
            settled.append(e)
            tests.append(test)

    for st in (n for n in walk(node.body) if isinstance(n, Store)):
        rewrite(st.value, on_select=lambda sel: settle(sel, sel.condition))
        if st.mask is not None:
            settle(st.mask, st.mask)
    return tuple(settled), conjunction(tests) if tests else None


_FLIPPED = {px.LT: (1, 1), px.LE: (1, 0), px.GT: (-1, 1), px.GE: (-1, 0)}  # a < b: b - a >= 1, ...


def _holds_on_tile(lw, node, cond, vm):
    """A test, once per tile, that ``cond`` holds at every element of the T.Parallel; None where its form is
    not one that a tile's corners bound."""
    if isinstance(cond, px.IntImm):
        return tirx.const(True, "bool") if cond.value else None
    if isinstance(cond, px.And) or isinstance(cond, px.BitwiseAnd) and str(cond.ty) == "bool":
        a, b = (_holds_on_tile(lw, node, c, vm) for c in (cond.a, cond.b))
        return None if a is None or b is None else tirx.And(a, b)
    if isinstance(cond, px.Select) and not any(uses(cond.condition, v) for v in node.vars):
        a, b = (_holds_on_tile(lw, node, c, vm) for c in (cond.true_value, cond.false_value))
        return None if a is None or b is None else tirx.Select(lw.expr(cond.condition, vm), a, b)
    if type(cond) not in _FLIPPED or not str(cond.a.ty).startswith("int"):
        return None
    sign, least = _FLIPPED[type(cond)]
    slack = (cond.b - cond.a) if sign > 0 else (cond.a - cond.b)  # the comparison is slack >= least
    rises = _rises(lw, node, slack)
    if rises is None:
        return None
    corner = {v: 0 if up else extent - 1 for v, extent, up in zip(node.vars, node.extents, rises)}  # its least
    return lw.ana.simplify(lw.expr(rewrite(slack, corner), vm) >= least)


def _rises(lw, node, e):
    """Per loop variable, whether ``e`` never falls (True) or never rises (False) as it steps; None where
    neither is provable.  A monotone ``e``'s extremes over the tile are then at its corners."""
    rises = []
    for v in node.vars:
        step = rewrite(e, {v: v + 1}) - e
        if lw.ana.can_prove(step >= 0):
            rises.append(True)
        elif lw.ana.can_prove(step <= 0):
            rises.append(False)
        else:
            return None
    return rises


def _true_sides(body: list, settled: tuple) -> list:
    """``body``'s statements with each select of ``settled`` (it holds on the whole tile) its true side, and
    each mask of ``settled`` gone."""
    def true_side(sel):
        return sel.true_value if any(sel.same_as(s) for s in settled) else None

    out = []
    for st in body:
        mask = None if st.mask is not None and any(st.mask.same_as(s) for s in settled) else st.mask
        out.append(Store(st.buffer, st.indices, rewrite(st.value, on_select=true_side), mask))
        out[-1].loc = st.loc
    return out


def _store(lw, st: Store, vm, frag_index, node, vec=1):
    if frag_index is not None:  # fragment indices must be the loop vars themselves (checked in inference)
        for buf_var, idx in _loads(st):
            buf = lw.buffers.get(buf_var)
            if buf is not None and buf.scope == "fragment" and not (
                    is_vars(idx, node.vars) or is_vars(idx, node.vars[:1])):
                raise error(st.loc, f"fragment {buf.name} must be indexed by the T.Parallel loop variables")
    if vec > 1:
        value = _lanes(lw, st.value, vm, node.vars[-1], vec)
    else:
        value = lw.expr(st.value, vm, frag_index, guard=True)
    mask = None if st.mask is None else lw.expr(st.mask, vm, frag_index, guard=True)  # one per vector (vec > 1)
    lw.guarded_store(st.buffer, [lw.expr(i, vm) for i in st.indices], value, frag_index, vec=vec, mask=mask)


def _loads(st: Store) -> list:
    """The (buffer var, indices) that a statement's value and mask load."""
    return collect_loads(st.value) + (collect_loads(st.mask) if st.mask is not None else [])


def _vector_width(lw, node: Parallel) -> int:
    """The widest vector along the innermost var j such that every statement is a lane-wise
    function of accesses contiguous in j (see _lanes)."""
    j = node.vars[-1]
    widths = [dtype_bits(b.dtype) for st in node.body for b in [st.buffer] + loaded(st.value, lw.buffers)]
    return widest(max(widths), lambda v: node.extents[-1] % v == 0 and broadcastable(min(widths), v) and all(
        _contiguous(lw, st.buffer, st.indices, j, v) and _lanes(lw, st.value, {}, j, v) is not None
        and (st.mask is None or not uses(st.mask, j)) for st in node.body))


def _lanes(lw, e, vm, j, vec):
    """``e`` at ``vec`` consecutive values of j, from the one ``vm`` gives: a vector where ``e``
    depends on j, the scalar where not; None where ``e`` is more than arithmetic and casts of
    contiguous loads, or has a value wider than 16 bytes (CUDA has no such vector types): the
    caller then takes a narrower vector or stays scalar."""
    if not uses(e, j):
        return lw.expr(e, vm, guard=True)
    if vec * dtype_bits(str(e.ty)) > 128:
        return None
    if isinstance(e, TensorLoad):
        buf = lw.buffers.get(e.source)
        if buf is None or not _contiguous(lw, buf, e.indices, j, vec):
            return None
        return lw.guarded_load(buf, [lw.expr(i, vm) for i in e.indices], vec=vec)
    if isinstance(e, px.BinaryOpExpr):
        a, b = _lanes(lw, e.a, vm, j, vec), _lanes(lw, e.b, vm, j, vec)
        return None if a is None or b is None else type(e)(broadcast(a, vec), broadcast(b, vec))
    if isinstance(e, px.Cast):
        v = _lanes(lw, e.value, vm, j, vec)
        return None if v is None else cast(v, str(e.ty))
    return None


def _contiguous(lw, buf, idx, j, vec) -> bool:
    """``buf[..., base + j]`` with j nowhere else, and ``vec`` elements from ``base + j`` (j a multiple
    of vec) one aligned access."""
    base = lw.ana.simplify(idx[-1] - j)
    if any(uses(i, j) for i in [base, *idx[:-1]]):
        return False
    return lw.vector_ok(buf, lw.expr(base), vec)
