"""Layout inference: give every fragment a layout.  The tile ops' rules (``ops/``) drive it: first what
each op's instruction imposes (a gemm's accumulator), then propagation through copies, reductions and
T.Parallel to a fixed point, then a default layout (rows of elements spread over the threads) for each
group of fragments that must share one, then the checks that need every layout."""

from __future__ import annotations

from ..lang import ir
from ..lang.ir import error, walk
from .exprs import dtype_bits
from .layout import BlockedLayout
from .ops import unit


class LayoutInference:
    def __init__(self, kernel: ir.Kernel, buffers: dict, wgmma: bool = False):
        self.kernel, self.buffers, self.wgmma = kernel, buffers, wgmma
        self.warps = kernel.threads // 32
        self.layouts: dict = {}  # TileBuffer -> FragmentLayout
        self.origin: dict = {}  # TileBuffer -> node that fixed its layout
        self.parallel: dict = {}  # id(Parallel node) -> anchor layout or None

    def run(self) -> "LayoutInference":
        nodes = list(walk(self.kernel.body))
        for node in nodes:
            unit(node).constrain(self, node)
        for _ in range(4):
            changed = False
            for node in nodes:
                changed |= unit(node).propagate(self, node)
            if not changed:
                break
        for node in nodes:
            unit(node).require(self, node)
        for group in self.unlaid_groups(nodes):  # one default per group: a copy or loop pairs their registers
            first = group[0]
            lay = BlockedLayout.make(first.shape, self.kernel.threads, max(dtype_bits(b.dtype) for b in group))
            if lay is None:
                raise error(first.loc, f"fragment {first.name}{list(first.shape)} cannot be split evenly over "
                                       f"{self.kernel.threads} threads")
            for buf in group:
                self.assign(buf, lay, buf)
        for node in nodes:
            unit(node).check(self, node)
        return self

    def unlaid_groups(self, nodes) -> list:
        """The fragments no op laid out, in groups that must share a layout (``TileOp.joined``: those a
        T.copy joins or one T.Parallel indexes in full).  A default per fragment would follow its own dtype
        (16 bytes a thread: 4 floats, 8 halves), and a cast copy between two would pair registers holding
        other elements."""
        unlaid = [b for b in self.kernel.allocs if b.scope == "fragment" and b not in self.layouts]
        parent = {b: b for b in unlaid}

        def root(b):
            while parent[b] is not b:
                b = parent[b]
            return b

        for node in nodes:
            joined = [b for b in unit(node).joined(self, node) if b in parent]
            for b in joined[1:]:
                parent[root(b)] = root(joined[0])
        groups: dict = {}
        for b in unlaid:
            groups.setdefault(root(b), []).append(b)
        return list(groups.values())

    def assign(self, buf, layout, node) -> bool:
        """Give ``buf`` ``layout`` (from ``node``); True if it had none, an error if it had another."""
        old = self.layouts.get(buf)
        if old is None:
            if tuple(layout.shape) != buf.shape:
                raise error(node.loc, f"fragment {buf.name}{list(buf.shape)} cannot take a layout of shape "
                                      f"{list(layout.shape)}")
            self.layouts[buf], self.origin[buf] = layout, node
            return True
        if old != layout:
            first = self.origin[buf].loc
            raise error(node.loc, f"fragment {buf.name} is used inconsistently: here it needs a {layout.kind} "
                                  f"layout, but line {first.lineno if first else '?'} gave it a {old.kind} layout "
                                  f"with another thread mapping")
        return False
