"""Which tile a block computes: the program's block indices, rasterized in panels (``T.use_swizzle``), and
on the warp-specialized path the persistent walk: one CTA per SM (or two) looping over the tiles
cta, cta + gridDim.x, ...  The producer then runs ahead into the next tile while the consumers store this
one's results, which hides the epilogue and the pipeline fill."""

from __future__ import annotations

import math
from contextlib import contextmanager

import tvm
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ..cuda import grid_x, once
from ..exprs import at_most, smin, uses


def tile_indices(lw, ids):
    """The program's block indices of the tile at ``ids``: ``rasterize``d, each one that depends on a runtime
    size (its raster divides by a ``T.dynamic`` tile count) bound once to a variable in the grid's range, so
    its divisions run once per tile rather than at every use (nvcc left them in the k-loop, where the
    producer's TMA issue fell behind)."""
    indices = rasterize(lw.kernel, ids)
    return [_bound_once(lw, e, f"tile_{'xyz'[i]}", extent) if any(uses(e, d) for d in lw.prog.dims) else e
            for i, (e, extent) in enumerate(zip(indices, lw.kernel.grid))]


def bind_values(lw):
    """The program's ``T.bind`` values for the tile the block indices name, each bound once to a variable that
    its uses then read."""
    for var, value in lw.kernel.bindings:
        bound = T.Var(var.name, "int32")
        T.Bind(once(lw.expr(value)), var=bound)
        lw.block_vars[var] = bound


def _bound_once(lw, e, name, extent):
    var = T.Var(name, "int32")
    T.Bind(once(e), var=var)
    lw.ana.bind(var, tvm.ir.Range.from_min_extent(0, extent))
    return var


def rasterize(kernel, ids):
    """T.use_swizzle: walk the grid in panels of `panel` columns so consecutive blocks share tiles in L2.
    A cluster's blocks move as one: the panels are of clusters."""
    panel = kernel.swizzle_panel
    if not panel:
        return ids
    cx, cy = kernel.cluster
    gx, gy = kernel.grid[0] // cx, kernel.grid[1] // cy
    bx, by = tirx.floordiv(ids[0], cx), tirx.floordiv(ids[1], cy) if cy > 1 else ids[1]
    linear = by * gx + bx
    per_panel = panel * gy
    pidx = tirx.floordiv(linear, per_panel)
    within = tirx.floormod(linear, per_panel)
    width = tirx.min(panel, gx - pidx * panel)
    x, y = pidx * panel + tirx.floormod(within, width), tirx.floordiv(within, width)
    return [x * cx + tirx.floormod(ids[0], cx) if cx > 1 else x,
            y * cy + tirx.floormod(ids[1], cy) if cy > 1 else y] + ids[2:]


class TileWalk:
    """The tiles of a warp-specialized kernel's CTA: all of them in turn when ``persistent`` is set (the
    tile count and the program's grid), else the CTA's own."""

    def __init__(self, lw):
        self.lw = lw
        self.persistent = None  # (tiles, program grid) once grid() chose a tile loop
        self.tile_ordinal = None  # the running tile's place among the CTA's tiles
        self.cta_tiles = None  # how many tiles the CTA walks

    def grid(self, grid: list) -> list:
        """Launch one CTA per SM when there is more than one wave of tiles (always with pingpong, whose
        warpgroups take a CTA's tiles in turns, with stream-K, whose CTAs walk units, and with an op that
        ``walks_tiles``, e.g. T.row_reduce_store, whose row's tiles must all be resident); the grid returned
        is the target's, the launcher sizes it to the device it runs on (Kernel.grid_on)."""
        lw, ws = self.lw, self.lw.ws
        total = math.prod(grid)
        walks = lw.consumers > 1 or ws.stream_k or lw.walks_tiles
        if not lw.kernel.persistent or (at_most(total, ws.resident_ctas()) and not walks):
            return grid
        self.persistent = (total, grid)
        return [smin(ws.resident_ctas(), self.work_units()), 1, 1]

    def work_units(self) -> int:
        """The most units of work a persistent grid walks (tiles; with stream-K, tiles' K parts at most):
        the launcher launches no more CTAs than that."""
        sk = self.lw.ws.stream_k
        return math.prod(self.persistent[1]) * (sk.most if sk else 1)

    @contextmanager
    def tiles(self, cta, consumer=None):
        """The CTA's tiles cta, cta + gridDim.x, ...; a pingpong ``consumer`` warpgroup takes every other
        one of them, starting with its ``consumer``-th (the producer, None, loads them all in order)."""
        lw = self.lw
        if self.persistent is None:
            yield
            return
        total, (gx, gy, _) = self.persistent
        ctas = grid_x()  # the launcher sizes the grid to the device
        if lw.ws.stream_k:
            yield from lw.ws.stream_k.units(cta, ctas, total, lambda t: self.enter(t, gx, gy), self)
            return
        snake = self._snake_order()
        if snake:
            rounds, rest = tirx.truncdiv(total, ctas), tirx.truncmod(total, ctas)
            last_ours = tirx.Select(tirx.truncmod(rounds, 2) == 0, cta < rest, cta >= ctas - rest)
            self.cta_tiles = rounds + tirx.Cast("int32", last_ours)
        else:
            self.cta_tiles = tirx.truncdiv(total - cta + (ctas - 1), ctas)  # all terms >= 0
        if consumer is None:
            mine, every, first = self.cta_tiles, 1, 0
        else:
            every, first = lw.consumers, consumer
            mine = tirx.truncdiv(self.cta_tiles - first + (every - 1), every)
        with T.serial(0, mine) as it:
            IRBuilder.name("tile_iter", it)
            self.tile_ordinal = it * every + first if every > 1 else it  # among the CTA's tiles
            o = self.tile_ordinal
            mine_in_round = tirx.Select(tirx.truncmod(o, 2) == 0, cta, ctas - 1 - cta) if snake else cta
            self.enter(mine_in_round + o * ctas, gx, gy)
            yield

    def _snake_order(self) -> bool:
        """Whether the CTAs take the tiles in snake order (round r's tiles to CTAs 0, 1, ... on even rounds and
        ..., 1, 0 on odd ones): where the main loop's step count depends on the tile (causal or windowed
        attention), so that each CTA's sum of steps evens out; the plain order can leave one CTA 12 % (4k
        tokens) to 65 % (short sequences) more steps than the mean, the snake about 3 %."""
        lw = self.lw
        per_tile = lw.kernel.block_vars + [var for var, _ in lw.kernel.bindings]
        return lw.ws.loop is not None and not lw.walks_tiles and any(uses(lw.ws.loop.extent, v) for v in per_tile)

    def enter(self, t, gx, gy):
        """Set the program's block indices to tile t's (in grid order, then rasterized)."""
        lw = self.lw
        (cx, cy), n = lw.cluster_dims, lw.cluster
        # cluster c = t // n of the grid of clusters, rank r = t % n at (r % cx, r // cx) in it
        c, r, ccx, ccy = tirx.floordiv(t, n), tirx.floormod(t, n), gx // cx, gy // cy
        ids = [tirx.floormod(c, ccx) * cx + tirx.floormod(r, cx),
               tirx.floormod(tirx.floordiv(c, ccx), ccy) * cy + tirx.floordiv(r, cx), tirx.floordiv(c, ccx * ccy)]
        lw.block_vars = dict(zip(lw.kernel.block_vars, tile_indices(lw, ids[: len(lw.kernel.grid)])))
        bind_values(lw)
