"""``T.copy(src, dst)``: a tile between global, shared and fragment storage, cast when the dtypes differ,
predicated at a global tensor's edges.  Global -> shared is asynchronous where it can be (``cp.async``,
or TMA under the warp-specialized schedule); a fragment moves in its layout's runs of columns; any other
pair is spread over the block's threads, as wide vectors as both sides allow."""

from __future__ import annotations

from tvm import tirx
from tvm.tirx.script import builder as T

from ...lang.ir import Copy, error
from ..exprs import cast, dtype_bits, pad, ramp, squeeze, vector_load, widest
from ..targets import sm80
from . import TileOp, tile_op


@tile_op(Copy)
class CopyOp(TileOp):
    def reads(self, node, buffers):
        return [node.src.buffer]

    def writes(self, node):
        return [node.dst.buffer]

    def propagate(self, inf, node):
        s, d = node.src.buffer, node.dst.buffer
        if s.scope != "fragment" or d.scope != "fragment":
            return False
        changed = False
        for a, b in ((s, d), (d, s)):
            if a in inf.layouts and b not in inf.layouts:
                changed |= inf.assign(b, inf.layouts[a], node)
        if s in inf.layouts and d in inf.layouts and inf.layouts[s] != inf.layouts[d]:
            raise error(node.loc, f"T.copy between fragments {s.name} and {d.name} with different layouts")
        return changed

    def joined(self, inf, node):
        return [node.src.buffer, node.dst.buffer]

    def lower(self, lw, node, vm):
        copy(lw, node, vm)


def copy(lw, node: Copy, vm, stage=None, asynchronous=False):
    """Lower ``node``; ``stage``: the pipeline stage a global -> shared copy fills (default: the one being
    computed on); ``asynchronous``: leave its cp.async group uncommitted (the pipeline commits it)."""
    if lw.ws and lw.ws.is_tma_store(node):
        return lw.ws.tma_store(node, vm)
    src, dst = node.src, node.dst
    s_scope, d_scope = src.buffer.scope, dst.buffer.scope
    if "local" in (s_scope, d_scope):  # each thread would move only its share of the window, in its own array
        local = src.buffer if s_scope == "local" else dst.buffer
        raise error(node.loc, f"T.copy: {local.name} is a local (per-thread) buffer, and a copy is spread over the "
                              f"block's threads; accepted: global, shared and fragment tiles (a local buffer is "
                              f"filled by T.fill or element assignments, which every thread runs whole)")
    extents = copy_extents(lw, node)
    s_start = [lw.expr(x, vm) for x in src.starts]
    d_start = [lw.expr(x, vm) for x in dst.starts]
    if "fragment" in (s_scope, d_scope):
        return _copy_fragment(lw, node, s_start, d_start, extents)
    if s_scope == "global" and d_scope == "shared":
        return _copy_global_to_shared(lw, node, s_start, d_start, extents,
                                      lw.stage(dst.buffer) if stage is None else stage, asynchronous)
    sync_copy(lw, node, s_start, d_start, extents)


def is_async_load(lw, node) -> bool:
    """A global -> shared copy into a multi-buffered tile: a pipelined loop's load, issued stages ahead."""
    return (isinstance(node, Copy) and node.src.buffer.scope == "global" and node.dst.buffer.scope == "shared"
            and lw.shared[node.dst.buffer].stages > 1)


def copy_extents(lw, node: Copy):
    """The extents of the region copied: the sliced side's (both sliced: they must agree)."""
    se, de = node.src.extents, node.dst.extents
    if None in se and None in de:
        raise error(node.loc, "T.copy: at least one side must be a whole buffer or a sliced region")
    ext = de if None in se else se
    other = se if None in se else de
    ext = squeeze(ext) or [1]
    if None not in other and squeeze(other) != squeeze(ext):
        raise error(node.loc, f"T.copy: region shapes differ: {list(se)} vs {list(de)}")
    point = node.src if None in se else node.dst  # a start point: its window takes the region's shape
    if len(point.starts) < len(ext):
        raise error(node.loc, f"T.copy: {point.buffer.name}{list(point.buffer.shape)} has {len(point.starts)} "
                              f"dim(s), too few for the {'x'.join(map(str, ext))} region copied with it; accepted: "
                              f"a buffer of at least {len(ext)} dims, one start index each")
    for side in (node.src, node.dst):
        _check_inside(lw, node, side, ext)
    return list(ext)


def _check_inside(lw, node: Copy, side, ext):
    """A shared or local window of a copy lies inside its buffer: only global accesses are predicated,
    so one reaching past the end would write (or read) the neighbouring tiles' bytes."""
    buf = side.buffer
    if buf.scope == "global":
        return
    ext = side.extents if None not in side.extents else [1] * (len(side.starts) - len(ext)) + list(ext)
    for s, e, dim in zip(side.starts, ext, buf.shape):
        s = tirx.const(s, "int32") if isinstance(s, int) else s
        if lw.ana.can_prove(tirx.Or(s + e > dim, s < 0)):
            window = ", ".join(f"{a}:{a + b}" for a, b in zip(side.starts, ext))
            raise error(node.loc, f"T.copy: the window [{window}] of {buf.name}{list(buf.shape)} reaches past "
                                  f"it (shared and local tiles are not predicated, only global tensors are)")


def sync_copy(lw, node, s_start, d_start, extents, d_stage=None):
    """Elementwise copy (any scopes but fragments), ``vec`` consecutive elements per thread and access."""
    sb, db = node.src.buffer, node.dst.buffer
    vec = copy_vector_width(lw, node, s_start, d_start, extents)

    def one(idx):
        value = lw.guarded_load(sb, [a + b for a, b in zip(s_start, pad(idx, s_start))], vec=vec)
        lw.guarded_store(db, [a + b for a, b in zip(d_start, pad(idx, d_start))], value, stage=d_stage, vec=vec)

    lw.flat_loop(extents, one, vec)


def copy_vector_width(lw, node, s_start, d_start, extents) -> int:
    sb, db = node.src.buffer, node.dst.buffer
    return widest(max(dtype_bits(sb.dtype), dtype_bits(db.dtype)), lambda v: extents[-1] % v == 0 and
                  lw.vector_ok(sb, s_start[-1], v) and lw.vector_ok(db, d_start[-1], v))


def _copy_global_to_shared(lw, node, s_start, d_start, extents, stage, asynchronous):
    """cp.async rows of 4 to 16 bytes into the stage being filled; a cast, a 1-D tile or rows too narrow
    take the synchronous path."""
    sb, db = node.src.buffer, node.dst.buffer
    t = lw.shared[db]
    if sb.dtype != db.dtype or len(extents) != 2 or t.layout is None:
        return sync_copy(lw, node, s_start, d_start, extents, stage)
    vec = copy_vector_width(lw, node, s_start, d_start, extents)
    if vec == 1:
        return sync_copy(lw, node, s_start, d_start, extents, stage)
    sm80.cp_async_tile(lw, node, s_start, d_start, extents, stage, vec, asynchronous)


def _copy_fragment(lw, node: Copy, s_start, d_start, extents):
    sb, db = node.src.buffer, node.dst.buffer
    frag = sb if sb.scope == "fragment" else db
    lay = lw.infer.layouts[frag]
    if squeeze(lay.shape) != squeeze(extents):
        raise error(node.loc, f"T.copy: fragment {frag.name}{list(frag.shape)} must be copied whole, "
                              f"got a region of {extents}")
    if sb.scope == "fragment" and db.scope == "fragment":
        with T.unroll(0, lay.local_size) as r:
            T.buffer_store(lw.frags[db], cast(tirx.BufferLoad(lw.frags[sb], [r]), db.dtype), [r])
        return
    other, start = (db, d_start) if sb.scope == "fragment" else (sb, s_start)
    vec = _fragment_vector_width(lw, lay, other, start)
    with T.unroll(0, lay.local_size // vec) as rv:
        r = rv * vec
        idx = list(lay.coords(lw.tid, r))
        o_idx = [a + b for a, b in zip(start, pad(idx, start))]
        if sb.scope == "fragment":
            lw.guarded_store(db, o_idx, vector_load(lw.frags[sb], [r], vec), vec=vec)
        else:
            value = lw.guarded_load(sb, o_idx, vec=vec)
            T.buffer_store(lw.frags[db], cast(value, db.dtype), [ramp(r, vec)])


def _fragment_vector_width(lw, lay, other, start) -> int:
    """Elements a thread moves per access: the layout's run of consecutive columns, if the other
    side allows them as one access."""
    vec = lay.vec
    return vec if vec > 1 and lay.local_size % vec == 0 and lw.vector_ok(other, start[-1], vec) else 1
