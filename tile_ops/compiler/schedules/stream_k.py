"""Stream-K on the warp-specialized sm_90a path (``T.Kernel(..., stream_k=p)``): the tiles that leave the
last wave of CTAs part-empty are split along the main loop's K steps over the idle CTAs.

The schedule, over ``tiles`` (clusters' tiles when clustered) and ``groups`` (the CTAs, or clusters,
of the persistent grid, known at run time): ``left = tiles % groups`` tiles would run alone in the
last wave, so each gets ``parts = min(groups // left, p, steps // MIN_STEPS)`` K parts (when that is
>= 2).  The split units come first: unit u < left * parts is part u % parts of tile u // parts, the
rest are whole tiles left, left + 1, ...  Group g runs units g, g + groups, ...  So every split unit
is in the first wave (all parts of a tile are resident at once) and a tile's owner, its last part,
waits only on lower-numbered units: what CUTLASS's SM90 stream-K scheduler does.

The fixup (after the main loop): a writer stores its fp32 accumulators into its slot of the workspace
(register order, striped: chunk i of thread t at i * threads + t, so the stores coalesce), meets the
other consumers at a barrier, and one thread makes them visible (``fence.acq_rel.gpu``) and counts
them on the tile's flag (``red.gpu.add``); the writer then skips the rest of the tile.  The owner's
thread waits until the flag counts every writer (``ld.acquire.gpu``), resets it for the next launch,
meets the others at a barrier, and all add the partials before the rest of the tile (the epilogue).

Workspace (kept by the launcher per device and stream, zeroed once, shared by every stream-K kernel
launched there): ``FLAG_SLOTS`` int32 flags (one per CTA at most), then a slot of ``floats_per_cta``
partial accumulators per CTA.  Every kernel leaves the flags zero, wherever its partials went."""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ...lang.ir import Copy, Fill, Gemm, error
from ..cuda import emit_ptx, helper
from ..exprs import ramp
from ..meta import FLAG_SLOTS

MIN_STEPS = 4  # K steps a part keeps at least: each part pays a pipeline fill and a partial round trip


class Ints:
    """The schedule's operations on Python ints (host-side checks and tests)."""

    min, max = min, max

    @staticmethod
    def select(c, a, b):
        return a if c else b

    @staticmethod
    def both(a, b):
        return bool(a and b)

    @staticmethod
    def bind(name, v):
        return v


class Registers:
    """The schedule's operations as int32 TIR, each named value stored in a register once: the nested
    selects would otherwise be substituted into every use (and TVM's simplifier chokes on them)."""

    min, max, select, both = (staticmethod(f) for f in (tirx.min, tirx.max, tirx.Select, tirx.all))

    def __init__(self):
        self.regs = T.alloc_local([len(FIELDS)], "int32")
        IRBuilder.name("stream_k", self.regs)

    def bind(self, name, v):
        i = FIELDS.index(name)
        T.buffer_store(self.regs, v, [i])
        return self.regs[i]


FIELDS = ("parts", "split_tiles", "base", "extra", "first_tile", "first_part", "units",  # per CTA, once
          "in_split", "tile", "k_begin", "k_steps", "writer", "owner")  # per unit


def plan(g, tiles, groups, steps: int, most: int, ops=Ints) -> dict:
    """What group g computes once: ``parts`` K parts of each of the ``split_tiles`` split tiles (1, 0: no
    split), the K steps of a part (``base``, one more for the first ``extra`` parts), the ``units`` of work
    in all, and the tile and part of g's first unit, the only one of its units that can be a split one
    (the split units are the first wave).  Divisions happen here, not per unit."""
    left = tiles % groups
    parts = ops.min(ops.min(groups // ops.max(left, 1), most), steps // MIN_STEPS)
    parts = ops.bind("parts", ops.select(ops.both(left > 0, parts >= 2), parts, 1))
    split_tiles = ops.bind("split_tiles", ops.select(parts > 1, left, 0))
    return {"parts": parts, "split_tiles": split_tiles, "split_units": split_tiles * parts,
            "units": ops.bind("units", split_tiles * parts + tiles - split_tiles),
            "base": ops.bind("base", steps // parts), "extra": ops.bind("extra", steps % parts),
            "first_tile": ops.bind("first_tile", g // parts), "first_part": ops.bind("first_part", g % parts)}


def unit(g, it, groups, steps: int, p: dict, ops=Ints) -> dict:
    """Unit u = g + it * groups (group g's it-th): its tile, K range [k_begin, k_begin + k_steps), and role:
    ``writer`` (a split tile's part other than the last: stores its partial in workspace slot u),
    ``owner`` (a split tile's last part: adds the partials of slots tile * parts .. tile * parts + parts - 2).
    ``p``: ``plan(g, ...)``; ``ops``: Ints, or Registers in a kernel."""
    u = g + it * groups
    in_split = ops.bind("in_split", ops.select(u < p["split_units"], 1, 0)) > 0  # then u == g
    part = ops.select(in_split, p["first_part"], 0)
    return {"parts": p["parts"], "slot": u,
            "tile": ops.bind("tile", ops.select(in_split, p["first_tile"], p["split_tiles"] + u - p["split_units"])),
            "k_begin": ops.bind("k_begin", ops.select(in_split, part * p["base"] + ops.min(part, p["extra"]), 0)),
            "k_steps": ops.bind("k_steps", ops.select(in_split, p["base"] + ops.select(part < p["extra"], 1, 0), steps)),
            "writer": ops.bind("writer", ops.select(ops.both(in_split, part < p["parts"] - 1), 1, 0)),
            "owner": ops.bind("owner", ops.select(ops.both(in_split, part == p["parts"] - 1), 1, 0))}


def accumulators(kernel, loop) -> list:
    """The fragments the main loop's gemms accumulate into.  The loop must be at the body's top level and
    hold only copies and gemms, each accumulator cleared (T.clear) before it: then the K parts' sums add
    up to the tile's."""
    if loop not in kernel.body:
        raise error(kernel.loc, "stream_k needs the T.Pipelined loop at the top level of the kernel body")
    if not all(isinstance(n, (Copy, Gemm)) and not getattr(n, "clear_accum", False) for n in loop.body):
        raise error(kernel.loc, "stream_k needs a main loop of T.copy and accumulating T.gemm only: its K parts' "
                                "accumulators are summed, which other state carried across K steps would not allow")
    accs = list(dict.fromkeys(g.C for g in loop.body if isinstance(g, Gemm)))
    if not accs:
        raise error(kernel.loc, "stream_k: the main loop has no T.gemm to split along K")
    before = kernel.body[: kernel.body.index(loop)]
    for acc in accs:
        fills = [n for n in before if isinstance(n, Fill) and n.buffer is acc]
        if not fills or not (isinstance(fills[-1].value, (int, float)) and fills[-1].value == 0):
            raise error(kernel.loc, f"stream_k: the accumulator {acc.name} must be cleared (T.clear) before the main "
                                    f"loop, so that the K parts' sums add up")
    return accs


class StreamK:
    """The K split of one kernel's last wave: ``accs`` the accumulators, ``most`` the most parts of a tile,
    ``steps`` the main loop's K steps per tile; ``unit`` the unit being walked (its fields and ``rank``)."""

    def __init__(self, lw, accs: list, most: int, steps: int):
        self.lw, self.accs, self.most, self.steps = lw, accs, most, steps
        self.unit = None

    def floats_per_cta(self) -> int:
        return sum(self.lw.infer.layouts[a].local_size for a in self.accs) * self.lw.threads

    def units(self, cta, ctas, total, enter, walk):
        """The walk: group (cluster) g of the grid's takes units g, g + groups, ...; a unit's tile of every
        block of the cluster is the tile of rank r in its cluster's tile (``enter(t)`` sets block indices,
        ``walk.tile_ordinal`` counts the units)."""
        n = self.lw.cluster
        groups, g, rank = tirx.floordiv(ctas, n), tirx.floordiv(cta, n), tirx.floormod(cta, n)
        regs = Registers()
        p = plan(g, total // n, groups, self.steps, self.most, regs)
        with T.serial(0, tirx.floordiv(p["units"] - g + groups - 1, groups)) as it:
            IRBuilder.name("unit_iter", it)
            walk.tile_ordinal = it
            self.unit = {**unit(g, it, groups, self.steps, p, regs), "rank": rank}
            enter(self.unit["tile"] * n + rank)
            yield
        self.unit = None

    def fixup(self, barrier_id, threads):
        """After the main loop: writers publish their partials, owners add the others' (``barrier_id``,
        ``threads``: the consumers' named barrier).  Returns the condition under which the rest of the tile
        runs (not a writer)."""
        lw, u, n = self.lw, self.unit, self.lw.cluster
        rank, workspace = u["rank"], lw.workspace
        flags = T.address_of(workspace[0])
        flag = u["tile"] * n + rank
        with T.If(u["writer"] != 0):
            with T.Then():
                self._partials(workspace, u["slot"] * n + rank, store=True)
                emit_ptx("bar.sync", barrier_id, threads)
                with T.If(lw.tid == 0):
                    with T.Then():
                        T.evaluate(flag_signal(flags, flag))
        with T.If(u["owner"] != 0):
            with T.Then():
                with T.If(lw.tid == 0):
                    with T.Then():
                        T.evaluate(flag_wait(flags, flag, u["parts"] - 1, reset=True))
                emit_ptx("bar.sync", barrier_id, threads)
                with T.serial(0, u["parts"] - 1) as p:
                    IRBuilder.name("part", p)
                    self._partials(workspace, (u["tile"] * u["parts"] + p) * n + rank, store=False)
        return u["writer"] == 0

    def _partials(self, workspace, cta_slot, store: bool):
        """Store this CTA's accumulators into workspace slot ``cta_slot``, or add that slot into them."""
        lw, base = self.lw, FLAG_SLOTS + cta_slot * self.floats_per_cta()
        for acc in self.accs:
            frag, size = lw.frags[acc], lw.infer.layouts[acc].local_size
            vec = 4 if size % 4 == 0 else 2 if size % 2 == 0 else 1
            for i in range(size // vec):
                at = base + (i * lw.threads + lw.tid) * vec
                mine, there = ramp(i * vec, vec), ramp(at, vec)
                if store:
                    T.buffer_store(workspace, tirx.BufferLoad(frag, [mine]), [there])
                else:
                    T.buffer_store(frag, tirx.BufferLoad(frag, [mine]) + tirx.BufferLoad(workspace, [there]), [mine])
            base = base + size * lw.threads


_HELPERS = {
    # every write this count stands for is before this (a barrier, or an mbarrier's acquire): the fence
    # makes them visible at GPU scope (cumulativity) before the count
    "tile_ops_flag_signal": """
__forceinline__ __device__ void tile_ops_flag_signal(float* flags, int flag) {
  int* f = reinterpret_cast<int*>(flags) + flag;
  asm volatile("fence.acq_rel.gpu;\\n red.relaxed.gpu.global.add.s32 [%0], 1;" :: "l"(f) : "memory");
}
""",
    # spin until the flag reaches `count` (acquire); `reset`: the only reader sets it back to 0 for the next
    # launch (kernel boundaries order that store before any of the next launch's)
    "tile_ops_flag_wait": """
__forceinline__ __device__ void tile_ops_flag_wait(float* flags, int flag, int count, int reset) {
  int* f = reinterpret_cast<int*>(flags) + flag;
  int seen;
  do {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(f) : "memory");
  } while (seen < count);
  if (reset) asm volatile("st.relaxed.gpu.global.s32 [%0], 0;" :: "l"(f) : "memory");
}
""",
}


def flag_signal(flags, flag):
    """Count one more completed writer on workspace flag ``flag`` (``flags``: the workspace's address)."""
    return helper("tile_ops_flag_signal", _HELPERS["tile_ops_flag_signal"], flags, flag)


def flag_wait(flags, flag, count, reset: bool):
    """Wait until workspace flag ``flag`` counts ``count`` writers; ``reset``: then zero it (its only reader)."""
    return helper("tile_ops_flag_wait", _HELPERS["tile_ops_flag_wait"], flags, flag, count, int(reset))
