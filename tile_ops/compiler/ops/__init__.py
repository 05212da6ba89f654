"""The tile ops: one unit per node type of the tile IR (``lang.ir``), registered with ``@tile_op``.

A unit declares
- the buffers the op reads and writes: the lowering's barriers, the stage checks and the shared-memory
  overlay ask these, never the node's type;
- its layout rules, which ``infer.LayoutInference`` drives to a fixed point: ``constrain`` (what the
  instruction it chooses imposes), ``propagate`` (one step), ``require`` (what propagation alone must have
  laid out), ``joined`` (fragments that must share a default layout), ``check`` (once every fragment has one);
- the shared memory and mbarriers it needs beyond its buffers (``scratch_bytes``, ``regions``, ``mbarriers``);
- its lowering, ``lower(lw, node, vm)``, through the instructions of the target (``targets/sm80``, ``sm90``)
  and the kernel's schedule (``schedules/``); an op whose CTAs meet across tiles also takes the
  warp-specialized schedule's extension points (``walks_tiles`` and the hooks after ``setup``).

Adding a tile op: its node in ``lang/ir.py``, its function in ``lang/frontend.py``, a module here, and its
import below (the registration).
"""

from __future__ import annotations

from ...lang.ir import error, walk

REGISTRY: dict = {}  # lang.ir node type -> its TileOp


def tile_op(node_type):
    """Class decorator: the unit lowering ``node_type``."""

    def register(cls):
        REGISTRY[node_type] = cls()
        return cls

    return register


def unit(node) -> "TileOp":
    op = REGISTRY.get(type(node))
    if op is None:
        raise error(node.loc, f"cannot lower {type(node).__name__}")
    return op


class TileOp:
    orders_itself = False  # it syncs before its own first shared access: the driver puts no barrier before it
    walks_tiles = False  # it needs the warp-specialized schedule's persistent tile walk in grid order
    uses_producer_warp = False  # it runs code on a spare warp of the producer warpgroup (producer_warp)

    def reads(self, node, buffers) -> list:
        """The buffers the op reads (``buffers``: the program's tirx buffer var -> TileBuffer)."""
        return []

    def writes(self, node) -> list:
        return []

    # layout inference (infer.py)
    def constrain(self, inf, node) -> None:
        pass

    def propagate(self, inf, node) -> bool:
        return False

    def require(self, inf, node) -> None:
        pass

    def joined(self, inf, node) -> list:
        return []

    def check(self, inf, node) -> None:
        pass

    # resources beyond its buffers (memory.py)
    def scratch_bytes(self, lw, node) -> int:
        """Shared memory it needs while it runs, reused by every op (the largest need is reserved)."""
        return 0

    def regions(self, lw, node) -> list:
        """[(name, float32 slots)] of shared memory it keeps for the whole kernel (one per consumer warpgroup)."""
        return []

    def mbarriers(self, lw, node) -> int:
        return 0

    # lowering (lower.py)
    def setup(self, lw, nodes) -> None:
        """Before the (consumer) threads' first statement of a kernel that has the op (``nodes``, in program
        order): the state it keeps across the kernel's tiles."""

    def touches_shared(self, lw, node) -> bool:
        """Whether it accesses shared memory with the block's threads: a barrier then orders it after the
        tile ops before it, whose thread mappings differ."""
        return any(b.scope == "shared" for b in self.reads(node, lw.buffers) + self.writes(node))

    def writes_shared(self, lw, node) -> bool:
        """Whether it writes shared memory (a tile, or the ops' scratch): two ops that only read it need no
        barrier between them."""
        return any(b.scope == "shared" for b in self.writes(node))

    def lower(self, lw, node, vm) -> None:
        raise NotImplementedError

    # the warp-specialized schedule's extension points (schedules/warp_specialized.py)
    def check_schedule(self, lw, node) -> None:
        """What the op needs of the kernel's schedule (``lw.ws``, None without warp specialization)."""

    def workspace_floats(self, lw, node) -> int:
        """float32 values the op keeps in the kernel's global workspace, after its flags."""
        return 0

    def workspace_flags(self, lw, node) -> int:
        """int32 flags the op uses at the workspace's start (of ``FLAG_SLOTS``)."""
        return 0

    def producer_warp(self, lw, node, cta) -> None:
        """The code of a spare warp of the producer warpgroup: the op's part off the consumers' path."""

    def finish_tile(self, lw, node, tile) -> None:
        """The consumers' point to finish the op's work of an earlier tile (``tile``, its ordinal among the CTA's
        tiles): right after each tile's main loop (the previous tile), and after the CTA's last tile."""


class Container(TileOp):
    """A node with a body: it accesses what its body does."""

    def reads(self, node, buffers) -> list:
        return [b for n in node.body for b in unit(n).reads(n, buffers)]

    def writes(self, node) -> list:
        return [b for n in node.body for b in unit(n).writes(n)]

    def touches_shared(self, lw, node) -> bool:
        return any(unit(n).touches_shared(lw, n) for n in node.body)

    def writes_shared(self, lw, node) -> bool:
        return any(unit(n).writes_shared(lw, n) for n in node.body)


def setup(lw) -> None:
    """Every tile op's ``setup``, for the ops the kernel has."""
    present: dict = {}
    for node in walk(lw.kernel.body):
        present.setdefault(unit(node), []).append(node)
    for op, nodes in present.items():
        op.setup(lw, nodes)


def present(kernel) -> list:
    """(op, node) for each node of the kernel, in program order."""
    return [(unit(node), node) for node in walk(kernel.body)]


def accessed(node, buffers) -> list:
    """Every buffer ``node`` (and its body) reads or writes."""
    op = unit(node)
    return op.reads(node, buffers) + op.writes(node)


from . import atomic, cluster, copy, deferred, fill, gemm, loop, parallel, reduce, row_reduce, store  # noqa: E402,F401  (registration)
